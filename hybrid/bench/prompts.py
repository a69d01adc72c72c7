"""The fixed prompt set for quality and speed benchmarks: four classes plus held-out model text.

Each class is a few prompt+answer texts; teacher-forced scoring feeds the whole text, decode
timing starts from the prompt part. `heldout` is text from the model's own corpus that it was not
trained on: a `heldout.txt` in the model folder, or the test-split files its corpus manifest
names, read from this machine only where their sha256 matches.
"""
from __future__ import annotations

from pathlib import Path

CLASSES = ("code", "essay", "translate", "explain")

PROMPTS: dict[str, list[tuple[str, str]]] = {   # class -> [(prompt, answer)]
    "code": [
        ("Write a Python function that returns the n-th Fibonacci number.\n",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n"
         "        a, b = b, a + b\n    return b\n\n\nprint([fibonacci(i) for i in range(10)])\n"),
        ("Write a class that caches the results of a function.\n",
         "class Cache:\n    def __init__(self, fn, size=128):\n        self.fn = fn\n        self.size = size\n"
         "        self.data = {}\n\n    def __call__(self, key):\n        if key not in self.data:\n"
         "            if len(self.data) >= self.size:\n                self.data.pop(next(iter(self.data)))\n"
         "            self.data[key] = self.fn(key)\n        return self.data[key]\n"),
        ("Sort a list of words by length, then alphabetically.\n",
         "import numpy as np\n\nwords = ['expert', 'router', 'token', 'cache', 'layer']\n"
         "ordered = sorted(words, key=lambda w: (len(w), w))\nfor i, w in enumerate(ordered):\n"
         "    print(i, w, np.log(len(w)))\n"),
    ],
    "essay": [
        ("Write a short essay about why people keep old computers running.\n",
         "Old computers are not only machines; they are habits, tools and memories. A server that has "
         "worked for ten years still does its job, and replacing it costs money and time. Many people "
         "enjoy the challenge of making old hardware useful again. They learn how memory, disks and "
         "processors work together, and they find that a careful choice of software can make a slow "
         "machine feel quick. In the end, keeping a computer running is a small act of respect for the "
         "work that went into building it.\n"),
        ("Write a paragraph about the value of libraries in small towns.\n",
         "In a small town the library is often the only place where anyone can sit, read and learn "
         "without paying. Children come after school to do their homework, older people come to read "
         "the newspaper, and everyone can borrow a book for a few weeks. The library is also a meeting "
         "place: people talk about the weather, their gardens and the news of the day.\n"),
    ],
    "translate": [
        ("Translate into French: The weather is nice today and we are going to the park.\n",
         "Il fait beau aujourd'hui et nous allons au parc.\n"),
        ("Translate into German: Where is the train station? I would like to buy a ticket.\n",
         "Wo ist der Bahnhof? Ich möchte eine Fahrkarte kaufen.\n"),
        ("Translate into Spanish: My brother lives in a small house near the sea.\n",
         "Mi hermano vive en una casa pequeña cerca del mar.\n"),
        ("Translate into English: Le chat dort sur la chaise près de la fenêtre.\n",
         "The cat is sleeping on the chair near the window.\n"),
        ("Translate into Italian: We eat dinner together every Sunday evening.\n",
         "Ceniamo insieme ogni domenica sera.\n"),
    ],
    "explain": [
        ("Explain how a mixture of experts model works.\n",
         "A mixture of experts model replaces one large feed-forward layer with many smaller ones, "
         "called experts. For every token a small router network scores all experts and picks the "
         "best few. Only those experts run, so the model can hold many parameters while each token "
         "uses only a small part of them. The outputs of the chosen experts are added together, "
         "weighted by the router's scores.\n"),
        ("Explain what a cache is.\n",
         "A cache is a small, fast store that keeps copies of data that was used recently, so that "
         "the next request for the same data is answered quickly. When the cache is full, a policy "
         "decides which entry to drop, for example the least recently used one.\n"),
        ("Explain what a Python generator is.\n",
         "A generator is a function that uses `yield` instead of `return`. Calling it does not run the "
         "body; it returns an iterator. Each call to `next()` runs the body until the next `yield`, "
         "hands out that value and pauses, keeping its local variables. When the body ends, the "
         "iterator raises `StopIteration`. Generators are useful for long or endless sequences, "
         "because they produce one item at a time instead of building a whole list in memory:\n\n"
         "    def count_up(n):\n        i = 0\n        while i < n:\n            yield i\n            i += 1\n"),
    ],
}

HELDOUT_FILES = ("heldout.txt",)
MANIFEST = "corpus_manifest.json.gz"
SKIP_PREFIXES = ("encodings/",)      # codec tables: long regular tables, not text


def class_texts() -> dict[str, str]:
    """class -> all of its prompt+answer texts joined by newlines (the teacher-forced stream)."""
    return {c: "\n".join(p + a for p, a in PROMPTS[c]) for c in CLASSES}


def class_prompts() -> dict[str, list[str]]:
    """class -> prompt parts only (decode timing starts there)."""
    return {c: [p for p, _ in PROMPTS[c]] for c in CLASSES}


def manifest_text(manifest: Path, split: str, max_bytes: int) -> tuple[str, list[str]]:
    """Files of one corpus split that this machine holds byte-identical (sha256 checked).

    The embedded tiny model was trained on Python's standard library; its manifest lists every
    file's split and sha256, so text is read from the local stdlib only where the bytes match
    exactly what the model's `split` held (test: held-out text; train: calibration text)."""
    import gzip
    import hashlib
    import json
    import sysconfig

    m = json.loads(gzip.decompress(manifest.read_bytes()))
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"]), "site": Path(paths["purelib"])}
    texts, sources, total = [], [], 0
    for root, rel, sha, _size, fsplit in m.get("files", []):
        if fsplit != split or root not in roots or rel.startswith(SKIP_PREFIXES) or total >= max_bytes:
            continue
        path = roots[root] / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != sha or (texts and total + len(data) > max_bytes):
            continue
        texts.append(data.decode("utf-8"))
        sources.append(f"{root}/{rel} sha256:{sha[:12]}")
        total += len(data)
    return "\n".join(texts), sources


def heldout(model_dir: str | Path, max_bytes: int = 32 * 1024) -> tuple[str, list[str]] | None:
    """(held-out text, its sources) for the model folder, or None when none is available here."""
    folder = Path(model_dir)
    for name in HELDOUT_FILES:
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8"), [name]
    if (folder / MANIFEST).is_file():
        text, sources = manifest_text(folder / MANIFEST, "test", max_bytes)
        if text:
            return text, sources
    return None


def all_texts(model_dir: str | Path | None = None) -> dict[str, str]:
    """The four classes plus `heldout` when the model's held-out text is available."""
    texts = class_texts()
    held = heldout(model_dir) if model_dir is not None else None
    if held:
        texts["heldout"] = held[0]
    return texts

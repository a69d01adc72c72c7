"""The fixed prompt set for quality and speed benchmarks: four classes plus held-out model text.

Each class is a few prompt+answer texts; teacher-forced scoring feeds the whole text, decode
timing starts from the prompt part. `heldout` text comes from the model folder when it ships one
(text the fixture model was not trained on, from its own corpus).
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
    ],
}

HELDOUT_FILES = ("heldout.txt", "corpus_heldout.txt", "eval.txt", "valid.txt")


def class_texts() -> dict[str, str]:
    """class -> all of its prompt+answer texts joined by blank lines (the teacher-forced stream)."""
    return {c: "\n".join(p + a for p, a in PROMPTS[c]) for c in CLASSES}


def class_prompts() -> dict[str, list[str]]:
    """class -> prompt parts only (decode timing starts there)."""
    return {c: [p for p, _ in PROMPTS[c]] for c in CLASSES}


def heldout_text(model_dir: str | Path) -> str | None:
    """Held-out text shipped with the model folder, if any."""
    for name in HELDOUT_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def all_texts(model_dir: str | Path | None = None) -> dict[str, str]:
    """The four classes plus `heldout` when the model folder has it."""
    texts = class_texts()
    held = heldout_text(model_dir) if model_dir is not None else None
    if held:
        texts["heldout"] = held
    return texts

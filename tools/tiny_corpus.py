"""Corpus for the tiny model: the running interpreter's standard library (.py + .txt/.rst prose)
plus plain-text documentation under a doc root (default /usr/share/doc), split by a fixed hash
of each file's path into train / val / test, with a manifest (path, sha256, bytes, split).
Also the byte-level BPE tokenizer trained on the train split.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EOT = "<|endoftext|>"
STDLIB_SUFFIXES = (".py", ".txt", ".rst")
DOC_SUFFIXES = (".txt", ".md", ".rst")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 1 << 20
MAX_DOC_FILE_BYTES = 256 << 10               # docs: skip big generated files
MAX_DOC_TOTAL_BYTES = 8 << 20                # docs: at most this much prose in all
DOC_SKIP_WORDS = ("changelog", "changes", "news", "relnotes", "release-notes", "history", "license", "copying")
SPLIT_MOD = 30          # hash(path) % 30: 0 -> val, 1 -> test, else train


@dataclass
class Doc:
    root: str           # "stdlib" | "doc"
    rel: str
    sha256: str
    nbytes: int
    split: str
    text: str = field(repr=False)


def _split_of(root: str, rel: str) -> str:
    h = int(hashlib.sha256(f"{root}/{rel}".encode()).hexdigest()[:12], 16) % SPLIT_MOD
    return "val" if h == 0 else "test" if h == 1 else "train"


def _walk(base: Path, suffixes, name_ok=lambda n: False):
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(suffixes) or name_ok(f):
                yield Path(dirpath) / f


def _read(path: Path, max_bytes: int = MAX_FILE_BYTES) -> tuple[bytes, str] | None:
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            return None
        raw = path.read_bytes()
        return raw, raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def collect(doc_root: str | None = "/usr/share/doc", limit: int | None = None) -> tuple[list[Doc], dict]:
    """Read the corpus; duplicates (same sha256) and non-UTF-8 files are skipped and counted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    sources = [("stdlib", stdlib, _walk(stdlib, STDLIB_SUFFIXES))]
    if doc_root and Path(doc_root).is_dir():
        readme = lambda n: n.upper().startswith("README") and not n.endswith(".gz")  # noqa: E731
        sources.append(("doc", Path(doc_root), _walk(Path(doc_root), DOC_SUFFIXES, readme)))
    docs, seen, skipped = [], set(), {"unreadable_or_large": 0, "duplicate": 0, "empty": 0,
                                      "doc_changelog_license": 0, "doc_over_total_cap": 0}
    doc_bytes = 0
    for root, base, paths in sources:
        for path in paths:
            is_doc = root == "doc"
            if is_doc and any(w in path.relative_to(base).as_posix().lower() for w in DOC_SKIP_WORDS):
                skipped["doc_changelog_license"] += 1
                continue
            got = _read(path, MAX_DOC_FILE_BYTES if is_doc else MAX_FILE_BYTES)
            if got is None:
                skipped["unreadable_or_large"] += 1
                continue
            raw, text = got
            sha = hashlib.sha256(raw).hexdigest()
            if not text.strip():
                skipped["empty"] += 1
                continue
            if sha in seen:
                skipped["duplicate"] += 1
                continue
            if is_doc and doc_bytes + len(raw) > MAX_DOC_TOTAL_BYTES:
                skipped["doc_over_total_cap"] += 1
                continue
            doc_bytes += len(raw) * is_doc
            seen.add(sha)
            rel = path.relative_to(base).as_posix()
            docs.append(Doc(root, rel, sha, len(raw), _split_of(root, rel), text))
    if limit:
        docs = [d for d in docs if d.split != "train"][:max(2, limit // 5)] + \
               [d for d in docs if d.split == "train"][:limit]
    roots = {"stdlib": str(stdlib), "doc": str(doc_root) if len(sources) > 1 else None}
    return docs, {"roots": roots, "skipped": skipped}


def manifest(docs: list[Doc], info: dict) -> dict:
    lines = sorted(f"{d.root}/{d.rel}\t{d.sha256}" for d in docs)
    by_split = {}
    for d in docs:
        s = by_split.setdefault(d.split, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += d.nbytes
    return {
        "corpus_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
        "python": sys.version.split()[0], "roots": info["roots"], "skipped": info["skipped"],
        "split_rule": f"int(sha256('<root>/<rel>')[:12], 16) % {SPLIT_MOD}: 0 val, 1 test, else train",
        "splits": by_split,
        "columns": ["root", "rel", "sha256", "bytes", "split"],
        "files": [[d.root, d.rel, d.sha256, d.nbytes, d.split] for d in docs],
    }


def write_manifest(m: dict, path: Path) -> None:
    data = json.dumps(m, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=9, mtime=0))


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer), <|endoftext|> = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
        "pad_token": EOT, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }


def encode_stream(tok, docs: list[Doc]) -> tuple[list[int], int]:
    """[EOT, doc0..., EOT, doc1..., ...] and the UTF-8 byte count of the docs."""
    eot = tok.token_to_id(EOT)
    out: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        out.append(eot)
        out.extend(enc.ids)
    return out, sum(d.nbytes for d in docs)

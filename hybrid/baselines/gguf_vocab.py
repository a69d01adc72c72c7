"""The tokenizer part of a GGUF: a gpt2-style byte-level BPE read from a Hugging Face tokenizer.json.

llama.cpp splits text with a regex picked by `tokenizer.ggml.pre` before BPE. We map the
`tokenizers` pre-tokenizer of the model onto the llama.cpp pre-type that splits identically:
- ByteLevel(add_prefix_space=False, use_regex=True)            -> "gpt-2"
- Sequence[Split(<qwen2 regex>), ByteLevel(use_regex=False)]   -> "qwen2"
Anything else is refused (a wrong pre-type silently changes tokenization).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybrid.errors import CheckpointError

# gguf TokenType values (gguf.TokenType): NORMAL 1, CONTROL 3, USER_DEFINED 4, UNUSED 5.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

QWEN2_REGEX_PREFIX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"


@dataclass(slots=True)
class GGUFVocab:
    """Everything `tokenizer.ggml.*` needs. tokens/types are indexed by id, length = n_vocab."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.types):
            raise CheckpointError(f"tokenizer: {len(self.tokens)} tokens but {len(self.types)} token types")
        for name, tid in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
            if tid is not None and not 0 <= tid < len(self.tokens):
                raise CheckpointError(f"tokenizer: {name}_token_id={tid} outside vocab of {len(self.tokens)}")


def pre_tokenizer_name(pre: dict | None, where: str) -> str:
    """llama.cpp `tokenizer.ggml.pre` name whose split matches the tokenizers pre-tokenizer `pre`."""
    if pre and pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise CheckpointError(f"{where}: ByteLevel pre-tokenizer with add_prefix_space or without regex "
                                  "has no llama.cpp pre-type; expected add_prefix_space=false, use_regex=true")
        return "gpt-2"
    if pre and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
                and str(parts[0].get("pattern", {}).get("Regex", "")).startswith(QWEN2_REGEX_PREFIX)
                and not parts[1].get("use_regex", True)):
            return "qwen2"
    raise CheckpointError(f"{where}: pre-tokenizer {json.dumps(pre)[:120]} has no known llama.cpp pre-type; "
                          "expected ByteLevel(add_prefix_space=false) or the Qwen2 Split+ByteLevel sequence")


def _merges(model: dict) -> list[str]:
    """Merges as 'a b' strings (tokenizers >= 0.20 stores them as [a, b] pairs)."""
    out = []
    for m in model.get("merges", []):
        out.append(m if isinstance(m, str) else f"{m[0]} {m[1]}")
    return out


def _special_ids(folder: Path, cfg: dict) -> tuple[int | None, int | None, int | None, bool]:
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return cfg.get("bos_token_id"), eos, cfg.get("pad_token_id"), bool(tc.get("add_bos_token", False))


def read_vocab(folder: str | Path, n_vocab: int) -> GGUFVocab:
    """GGUFVocab from folder/tokenizer.json (+ config.json ids), padded with [PADi] to n_vocab."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing; a GGUF needs the model's tokenizer.json")
    tj = json.loads(path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"{path}: tokenizer model {model.get('type')!r}; expected BPE")
    if tj.get("normalizer") is not None:
        raise CheckpointError(f"{path}: normalizers are not supported by the gpt2 GGUF tokenizer")
    pre = pre_tokenizer_name(tj.get("pre_tokenizer"), str(path))
    by_id = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tj.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if by_id and max(by_id) >= n_vocab:
        raise CheckpointError(f"{path}: token id {max(by_id)} >= vocab_size {n_vocab} in config.json")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    cfg = json.loads((folder / "config.json").read_text())
    bos, eos, pad, add_bos = _special_ids(folder, cfg)
    return GGUFVocab(tokens, types, _merges(model), pre, bos, eos, pad, add_bos)


def write_vocab(writer, vocab: GGUFVocab) -> None:
    """Add tokenizer.ggml.* keys to a gguf.GGUFWriter."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    if vocab.pad_id is not None:
        writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)

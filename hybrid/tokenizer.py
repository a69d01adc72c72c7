"""Tokenizer through the `tokenizers` library, with BOS/EOS, stop strings and chat templates."""
from __future__ import annotations

import json
from pathlib import Path

from hybrid.errors import CheckpointError


class Tokenizer:
    def __init__(self, folder: str | Path, vocab_size: int, bos_id: int | None = None,
                 eos_ids: list[int] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing tokenizer.json")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from None
        n = self.tok.get_vocab_size(with_added_tokens=True)
        if n > vocab_size:
            raise CheckpointError(f"{path}: tokenizer has {n} tokens but config.json vocab_size is {vocab_size}")
        self.config = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        self.bos_id = bos_id if bos_id is not None else gen.get("bos_token_id")
        eos = eos_ids or gen.get("eos_token_id") or []
        self.eos_ids = set([eos] if isinstance(eos, int) else eos)
        eos_token_id = self._special_id(self.config.get("eos_token"))
        if eos_token_id is not None:
            self.eos_ids.add(eos_token_id)
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
        self.chat_template = self.config.get("chat_template")

    def _special_id(self, tok) -> int | None:
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self.tok.token_to_id(tok) if isinstance(tok, str) else None

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat(self, user: str, system: str | None = None) -> str:
        """Render the model's chat template for one user turn (generation prompt added)."""
        if not self.chat_template:
            raise CheckpointError("tokenizer_config.json: this model has no chat_template; drop --chat")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return env.from_string(self.chat_template).render(messages=msgs, add_generation_prompt=True,
                                                          bos_token="", eos_token="")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg})") from None


class StreamDecoder:
    """Incremental detokenizer: yields only text that is complete (no split UTF-8 sequences)."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

"""The generation loop: prefill the prompt, then decode token by token with a sampler."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hybrid.sampler import Sampler
from hybrid.tokenizer import StreamDecoder, Tokenizer


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = "length"

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first (which comes from prefill) over the decode time."""
        n = max(len(self.generated_ids) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def generate(model, tok: Tokenizer, prompt_ids: list[int], max_tokens: int, sampler: Sampler,
             stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
             prefill_chunk: int = 0) -> GenerationResult:
    """Greedy/sampled generation; on_text receives text pieces as they complete."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    res = GenerationResult(list(prompt_ids))
    model.new_cache(len(prompt_ids) + max_tokens)
    stream = StreamDecoder(tok)
    t0 = time.perf_counter()
    logits = _prefill(model, prompt_ids, prefill_chunk)
    history = list(prompt_ids)
    t1 = None
    for step in range(max_tokens):
        nxt = sampler(logits[-1], history)
        if step == 0:
            t1 = time.perf_counter()
            res.prefill_s = t1 - t0
        if nxt in tok.eos_ids:
            res.stop_reason = "eos"
            break
        res.generated_ids.append(nxt)
        history.append(nxt)
        piece = stream.push(nxt)
        res.text += piece
        if stop and any(s in res.text for s in stop):
            res.text = _cut_at_stop(res.text, stop)
            res.stop_reason = "stop"
            break
        if on_text and piece:
            on_text(piece)
        if step + 1 < max_tokens:
            logits = model.forward(torch.tensor([nxt]), len(history) - 1, last_only=True)
    if t1 is not None:
        res.decode_s = time.perf_counter() - t1
    return res


def _prefill(model, prompt_ids: list[int], chunk: int) -> torch.Tensor:
    ids = torch.tensor(prompt_ids)
    chunk = chunk or len(prompt_ids)
    for s in range(0, len(prompt_ids), chunk):
        logits = model.forward(ids[s:s + chunk], s, last_only=True)
    return logits


def _cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min(text.index(s) for s in stop if s in text)
    return text[:cut]

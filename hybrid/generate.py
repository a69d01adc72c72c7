"""The generation loop: prefill the prompt, then decode token by token with a sampler.

Overlapped decode (on CUDA by default, for models with `enqueue`, i.e. hybrid.runtime.HybridModel;
HYBRID_DECODE_OVERLAP=0 or generate(overlap=False) turns it off, overlap=True forces it): the next id
is sampled on the device (hybrid.sampler.DeviceSampler) and fed from there into the next step, so
step t+1 is enqueued before the host reads token t; the host then reads token t through a pinned
buffer and an event while the device runs step t+1, and does the detokenization, the stop checks
and step t's bookkeeping (model.finish: deferred cache lookups, trace, stats) in that shadow. Only
steps that need no host work between their launches run ahead (model.can_run_ahead: graphed, every
expert resident); any other step runs as before (model.forward, after the host has read its input
id), after the pending step's bookkeeping, so the caches see the same order of lookups. On EOS or a
stop string the step enqueued ahead is discarded (model.discard: its KV row is not committed,
nothing of it is counted); max_tokens never starts one. Greedy ids are the same with and without
the overlap (H200: 352 vs 198-204 tok/s all resident, results/runtime.md section 17).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hybrid.sampler import DeviceSampler, Sampler
from hybrid.switches import env_flag
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


def overlap_enabled() -> bool:
    """Overlapped decode on CUDA (module doc) unless HYBRID_DECODE_OVERLAP=0: then the host samples
    each step, then launches the next (the loop before overlap, for A/B runs)."""
    return env_flag("HYBRID_DECODE_OVERLAP")


def generate(model, tok: Tokenizer, prompt_ids: list[int], max_tokens: int, sampler: Sampler,
             stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
             prefill_chunk: int = 0, overlap: bool | None = None) -> GenerationResult:
    """Greedy/sampled generation; on_text receives text pieces as they complete. overlap: None = on
    for a model that supports it with logits on CUDA unless HYBRID_DECODE_OVERLAP=0 (module doc)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    res = GenerationResult(list(prompt_ids))
    model.new_cache(len(prompt_ids) + max_tokens)
    stream = StreamDecoder(tok)
    t0 = time.perf_counter()
    logits = prefill(model, prompt_ids, prefill_chunk)
    loop = _decode_overlap if _use_overlap(model, logits, overlap) else _decode
    t1 = loop(model, tok, res, stream, logits, max_tokens, sampler, stop, on_text)
    if t1 is not None:
        res.prefill_s = t1 - t0
        res.decode_s = time.perf_counter() - t1
    return res


def _use_overlap(model, logits: torch.Tensor, overlap: bool | None) -> bool:
    if overlap is False or not hasattr(model, "enqueue"):
        return False
    return overlap or (overlap_enabled() and logits.is_cuda)


def _decode(model, tok, res, stream, logits, max_tokens, sampler, stop, on_text) -> float | None:
    """The host samples each step's logits, then launches the next step. -> when token 0 was known."""
    history, t1 = list(res.prompt_ids), None
    for step in range(max_tokens):
        nxt = sampler(logits[-1], history)
        if step == 0:
            t1 = time.perf_counter()
        if not _take(res, history, stream, tok, nxt, stop, on_text):
            break
        if step + 1 < max_tokens:
            logits = model.forward(torch.tensor([nxt]), len(history) - 1, last_only=True)
    return t1


def _decode_overlap(model, tok, res, stream, logits, max_tokens, sampler, stop, on_text) -> float | None:
    """Sampling on the device, step t+1 enqueued before the host reads token t (module doc)."""
    history, t1, n = list(res.prompt_ids), None, len(res.prompt_ids)
    ds = DeviceSampler(sampler, history, logits.shape[-1], logits.device)
    tok_d, cur = ds(logits[-1])                        # token 0 [1] on the device, and on its way here
    pending = ahead = None                             # a step run ahead: its bookkeeping is due later
    try:
        for step in range(max_tokens):
            pos = n + step                             # token `step`'s position: the next step's input
            more = step + 1 < max_tokens
            ahead = None
            if step > 0 and more and model.can_run_ahead(pos):
                ahead = model.enqueue(tok_d, pos)      # step+1 runs while the host reads token `step`
                tok_d, nxt_h = ds(ahead.logits[-1])
            if pending is not None:
                model.finish(pending)                  # step `step`'s lookups, trace, stats
                pending = None
            nxt = cur.read()
            if step == 0:
                t1 = time.perf_counter()
            if not _take(res, history, stream, tok, nxt, stop, on_text):
                break
            if more and ahead is None:
                if model.can_run_ahead(pos):
                    ahead = model.enqueue(tok_d, pos)
                    tok_d, nxt_h = ds(ahead.logits[-1])
                else:                                  # a step with host work: as before
                    tok_d, nxt_h = ds(model.forward(torch.tensor([nxt]), pos, last_only=True)[-1])
            pending, cur = ahead, (nxt_h if more else None)
    finally:                                           # EOS / stop (or an error): never committed
        for p in {id(x): x for x in (ahead, pending) if x is not None}.values():
            model.discard(p)
    return t1


def _take(res: GenerationResult, history: list[int], stream: StreamDecoder, tok: Tokenizer, nxt: int,
          stop: list[str] | None, on_text) -> bool:
    """Token nxt: EOS ends; else append, detokenize, stop strings end, stream the text. -> go on?"""
    if nxt in tok.eos_ids:
        res.stop_reason = "eos"
        return False
    res.generated_ids.append(nxt)
    history.append(nxt)
    piece = stream.push(nxt)
    res.text += piece
    if stop and any(s in res.text for s in stop):
        res.text = _cut_at_stop(res.text, stop)
        res.stop_reason = "stop"
        return False
    if on_text and piece:
        on_text(piece)
    return True


def prefill(model, prompt_ids: list[int], chunk: int) -> torch.Tensor:
    """The prompt through model.forward in steps of `chunk` tokens (0: one step; a model with prefill_step may
    take smaller ones, HybridModel.prefill_step) -> the last step's logits."""
    ids = torch.tensor(prompt_ids)
    chunk = chunk or len(prompt_ids)
    if hasattr(model, "prefill_step"):
        chunk = model.prefill_step(len(prompt_ids), chunk)
    for s in range(0, len(prompt_ids), chunk):
        logits = model.forward(ids[s:s + chunk], s, last_only=True)
    return logits


def _cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min(text.index(s) for s in stop if s in text)
    return text[:cut]

"""Sampling: temperature, top-k, top-p, min-p, presence and repetition penalties, seed.

Temperature 0 is greedy (argmax, ties to the lowest id).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.errors import HybridError


@dataclass
class SamplerConfig:
    temperature: float = 0.0
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [(self.temperature >= 0, "--temperature must be >= 0"),
                  (self.top_k >= 0, "--top-k must be >= 0"),
                  (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
                  (0 <= self.min_p <= 1, "--min-p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "--repetition-penalty must be > 0")]
        for ok, msg in checks:
            if not ok:
                raise HybridError(msg)


class Sampler:
    def __init__(self, cfg: SamplerConfig):
        self.cfg = cfg
        self.gen = torch.Generator()
        if cfg.seed is not None:
            self.gen.manual_seed(cfg.seed)

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits [V] (any device) -> next token id."""
        c = self.cfg
        x = logits.detach().float().cpu().clone()
        if history and (c.presence_penalty or c.repetition_penalty != 1.0):
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            vals = x[seen]
            if c.repetition_penalty != 1.0:
                vals = torch.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty)
            x[seen] = vals - c.presence_penalty
        if c.temperature == 0:
            return int(torch.argmax(x))
        x = x / c.temperature
        if c.top_k:
            kth = torch.topk(x, min(c.top_k, x.numel())).values[-1]
            x[x < kth] = float("-inf")
        probs = torch.softmax(x, dim=-1)
        if c.min_p > 0:
            probs[probs < c.min_p * probs.max()] = 0
        if c.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < c.top_p            # always keeps the first
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))

"""Sampling: temperature, top-k, top-p, min-p, presence and repetition penalties, seed.

Temperature 0 is greedy (argmax, ties to the lowest id).

Sampler works on the host (the logits are copied to the CPU). DeviceSampler runs the same math on
the logits' device, so the sampled id can feed the next decode step without the host
(hybrid.generate's overlapped decode); the host reads it later through a pinned buffer (HostToken).
Greedy and the penalties are the same float32 operations on the same logits (divisions by device
tensors, not by host scalars, which CUDA would turn into a multiplication by the reciprocal):
the same ids. Temperature > 0: the draw is the one torch.multinomial makes on the CPU for one sample
(argmax(p / q), q ~ Exp(1)), with q drawn on the host from the Sampler's own seeded CPU generator and
uploaded: the same random stream as Sampler (one draw per sampled token, the discarded speculative
step's included); the ids can differ where the device's softmax / cumsum round differently at a
top-p / min-p boundary or a near tie.
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
        probs = _probs(x, c, c.temperature)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))


def _probs(x: torch.Tensor, c: SamplerConfig, temp) -> torch.Tensor:
    """Temperature, top-k, softmax, min-p, top-p: the distribution Sampler and DeviceSampler draw
    from (unnormalised after top-p). temp: the divisor as each passes it (a host scalar; on a device,
    a tensor: see the module doc)."""
    x = x / temp
    if c.top_k:
        kth = torch.topk(x, min(c.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if c.min_p > 0:
        probs = probs.masked_fill(probs < c.min_p * probs.max(), 0)
    if c.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = (sp.cumsum(0) - sp) < c.top_p            # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, si, torch.where(keep, sp, 0))
    return probs


class HostToken:
    """A sampled id on its way to the host: a pinned copy and the event after it (read() waits)."""

    def __init__(self, buf: torch.Tensor, event=None):
        self.buf, self.event = buf, event

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.buf[0])


class DeviceSampler:
    """Sampler's math on the logits' device (see the module doc). __call__(logits [V]) -> (id [1]
    int64 on the device, HostToken). history: the prompt ids (the penalties' seen set); every
    sampled id joins the set on the device."""

    RING = 4                                   # pinned id buffers in turn (at most 2 are unread)

    def __init__(self, sampler: Sampler, history: list[int], vocab: int, device):
        self.cfg, self.gen = sampler.cfg, sampler.gen
        c, dev = self.cfg, torch.device(device)
        self.device, self.cuda = dev, dev.type == "cuda"
        f32 = dict(dtype=torch.float32, device=dev)
        self.seen = None                                                      # [V] bool
        if c.presence_penalty or c.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            if history:
                self.seen[torch.tensor(sorted(set(history)), device=dev)] = True
        self._rep = torch.tensor(c.repetition_penalty, **f32)
        self._temp = torch.tensor(c.temperature or 1.0, **f32)
        self._ring = [torch.zeros(1, dtype=torch.int64, pin_memory=self.cuda) for _ in range(self.RING)]
        self._n = 0

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, HostToken]:
        tok = self._sample(logits.detach().float().reshape(-1))                # [1] int64
        if self.seen is not None:
            self.seen.index_fill_(0, tok, True)
        return tok, self._to_host(tok)

    def _sample(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if self.seen is not None:
            pen = x
            if c.repetition_penalty != 1.0:
                pen = torch.where(pen > 0, pen / self._rep, pen * c.repetition_penalty)
            x = torch.where(self.seen, pen - c.presence_penalty, x)
        if c.temperature == 0:
            return torch.argmax(x).view(1)
        probs = _probs(x, c, self._temp)
        q = torch.empty(x.numel(), dtype=torch.float32, pin_memory=self.cuda).exponential_(1, generator=self.gen)
        q = q.to(self.device, non_blocking=True)
        return torch.argmax((probs / probs.sum()) / q).view(1)      # torch.multinomial's one-sample draw

    def _to_host(self, tok: torch.Tensor) -> HostToken:
        if not self.cuda:
            return HostToken(tok)
        buf = self._ring[self._n % self.RING]
        self._n += 1
        buf.copy_(tok, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return HostToken(buf, ev)

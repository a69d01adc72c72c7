"""Offline replay of a routing trace through the very ExpertCache + policy code the runtime runs.

Two uses:
- `replay_run(trace)`: rebuild the caches the run started with (trace header "cards") and drive
  them with the run's own routing and per-step budgets; `verify(trace)` compares the per-step hits
  with the ones the run recorded. Same code, same order of calls, so they must match exactly.
- `replay(trace, policy, slots)`: what-if: one cache holding every layer with `slots` per layer.
  `belady(...)` is the same with the offline-optimal policy, its best warm start, and no budget:
  an upper bound on the hit rate of every policy under the cache's rules.
"""
from __future__ import annotations

from dataclasses import dataclass, replace as dc_replace
from typing import Mapping, Sequence

import numpy as np

from hybrid.experts.cache import CacheStats, ExpertCache
from hybrid.experts.policy import Belady, CachePolicy, make_policy
from hybrid.experts.popularity import ExpertProfile
from hybrid.experts.trace import Trace, TraceError


@dataclass
class ReplayResult:
    """hits / promotions: int64 [S, L], unique experts per step and layer (0 for layers no card holds)."""

    name: str
    caches: list[ExpertCache]
    hits: np.ndarray
    promotions: np.ndarray

    @property
    def stats(self) -> list[CacheStats]:
        return [c.stats() for c in self.caches]

    @property
    def hit_rate(self) -> float:
        h = sum(int(c.hits.sum()) for c in self.caches)
        m = sum(int(c.misses.sum()) for c in self.caches)
        return h / (h + m) if h + m else 0.0

    @property
    def promotions_per_step(self) -> float:
        return float(self.promotions.sum(axis=1).mean()) if len(self.promotions) else 0.0


def drive(trace: Trace, caches: Sequence[ExpertCache], name: str = "") -> ReplayResult:
    """Feed every step of the trace to the caches exactly as the runtime does (layer order)."""
    owner = {l: c for c in caches for l in c.layers}
    n_steps, n_layers = len(trace.steps), trace.header.num_layers
    hits = np.zeros((n_steps, n_layers), dtype=np.int64)
    promos = np.zeros_like(hits)
    for rec in trace.steps:
        budgets = rec.budget_bytes or [None] * len(caches)
        for cache, budget in zip(caches, budgets):
            cache.begin_step(budget)
        for layer in range(n_layers):
            if layer in owner:
                lk, done = owner[layer].access(layer, rec.ids[layer])
                hits[rec.step, layer], promos[rec.step, layer] = len(lk.hits), len(done)
    return ReplayResult(name, list(caches), hits, promos)


def replay_run(trace: Trace) -> ReplayResult:
    """Replay the run that wrote the trace: its caches, policy, warm start and budgets."""
    if not trace.header.cards:
        raise TraceError("trace has no cache description in its header (a routing-only trace)")
    caches = [ExpertCache.from_description(d) for d in trace.header.cards]
    return drive(trace, caches, name="run")


def verify(trace: Trace) -> list[str]:
    """Differences between the hits/promotions the run recorded and its replay ([] = identical)."""
    res = replay_run(trace)
    out = []
    for rec in trace.steps:
        for key, got in (("hits", res.hits), ("promotions", res.promotions)):
            want = getattr(rec, key)
            if want is not None and list(want) != got[rec.step].tolist():
                out.append(f"step {rec.step}: run {key} {list(want)} != replay {got[rec.step].tolist()}")
    return out


def requests(trace: Trace, layers: Sequence[int]) -> dict[int, list[np.ndarray]]:
    return {l: trace.requests(l) for l in layers}


def replay(trace: Trace, policy: str | Mapping | CachePolicy, slots: int | Sequence[int], *,
           profile: ExpertProfile | None = None, warm: bool = False, budget_experts: int | None = None,
           name: str | None = None) -> ReplayResult:
    """What-if: one cache over all layers, `slots` per layer; warm=True fills it from `profile`.

    The budgets a run recorded are ignored (the what-if sets its own); Belady always starts
    from its best warm start.

    budget_experts: promotions allowed per step over all layers (None = unbounded).
    """
    h = trace.header
    layers = list(range(h.num_layers))
    if not isinstance(policy, CachePolicy):
        policy = make_policy(policy, profile=profile, requests=requests(trace, layers))
    cache = ExpertCache(layers, slots, h.num_experts, policy, bytes_per_expert=1,
                        budget_bytes=budget_experts)
    if isinstance(policy, Belady):
        cache.warm_start({l: policy.initial(l, c) for l, c in zip(layers, cache.capacities)})
    elif warm and profile is not None:
        cache.warm_from_profile(profile)
    steps = [s if s.budget_bytes is None else dc_replace(s, budget_bytes=None) for s in trace.steps]
    return drive(Trace(h, steps), [cache], name=name or policy.name)


def belady(trace: Trace, slots: int | Sequence[int]) -> ReplayResult:
    """Offline optimum: Belady's policy, its best warm start, no PCIe budget."""
    return replay(trace, "belady", slots, name="belady")


"""Prefill offload threshold: from how many tokens a prefill step streams the experts its card misses
(hybrid.runtime.prefill_stream) instead of running them on the CPU runner. A cost model over the
hardware profile, not a constant: a PCIe 3 rig and an H200 cross over at very different sizes.

Legend: T tokens in the step, E experts per layer, k routed per token, G = PREFILL_STAGE_GROUP,
b_e stored bytes of expert e, p_e = P(a token routes to e): k/E (uniform routing) or min(1, k·share_e)
(the expert profile, hybrid.planner.popularity), M_e ~ Binomial(T, p_e) rows routed to e,
X = the layer's experts not in its card's slots (with an expert profile: all but its s_l most chosen),
U = Σ_{e∈X} P(M_e ≥ 1) experts touched that miss. Profile figures: B_cpu = cpu.nvfp4_kernel_gbs
(M = 1), r8 = cpu.nvfp4_m8_ratio (time of an M = 8 call / an M = 1 call; DEFAULT_M8_RATIO when the
profile predates it), B_h2d / B_d2h = the card's pinned copies, B_gpu = read_gbs × kernel_efficiency,
λ = launch_us (host time of one eager op), dispatch = overheads.cpu_dispatch_us.

CPU runner, one expert called with M rows, in units of its M = 1 call t1_e = b_e / B_cpu:
    c(M) = 1 + s·(M - 1),   s = max(0, r8 - 1) / 7       (exact at M = 1 and M = 8)
  The runner reads an expert's weights from memory once per call (cpu/i16.py streams each 8-row
  weight block once and repeats the decode and the products for every 8 tokens, from L1), so a row
  beyond 8 costs what a row below 8 does. Not charged: the decode repeated per 8-token chunk (the
  H200 host measured M = 2 and 4 at 1.35 and 1.92 where the line gives 1.24 and 1.73: the CPU is
  charged a little less than it costs there). With M ~ Binomial(T, p):
    E[c(M); M >= 1] = (1 - s)·P(M >= 1) + s·T·p
One layer that can miss (the routing read-back, lookup and promotions are the same on both paths):
    hits   = Σ_{e∉X} P(M_e ≥ 1)·b_e / B_gpu                         the grouped kernel, both paths
    cpu    = max(hits, dispatch + CPU_LAYER_OPS·λ + T·H·4/B_d2h + T·H·4/B_h2d
                       + Σ_{e∈X} t1_e·E[c(M_e); M_e ≥ 1])           x fp32 down, the CPU's sum up,
                                                                     the hits run meanwhile
    stream = hits + STREAM_LAYER_OPS·λ + max(Σ_{e∈X} P(M_e ≥ 1)·b_e / B_h2d, ⌈U/G⌉·STREAM_GROUP_OPS·λ)
             + min(U, G)·b̄ / B_gpu                                  the DMA of group i + 1 runs during
                                                                     group i's pack and kernel; the last
                                                                     group's kernel is not hidden
The session has one threshold: the smallest T in 1..chunk at which Σ over the plan's layers that can
miss of stream <= cpu (a single crossing: the CPU's cost per touched expert grows with its rows, the
stream's does not), found by bisection. None up to the prefill chunk (steps never exceed it): 0 =
offload off, and the staging area need not be reserved. Every layer resident: nothing to stream, 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid.planner.memory import PREFILL_STAGE_GROUP
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import CardPlan, PrefillPrediction
from hybrid.planner.popularity import Popularity
from hybrid.planner.profile import HardwareProfile

US = 1e6
DEFAULT_M8_RATIO = 2.62     # results/cpu_kernels_h200.md, tenth session: the lent H200 host, 16 threads,
                            # default build, median of paired rounds (2.37-2.79); for profiles without
                            # cpu.nvfp4_m8_ratio
SEARCH_MAX = 8192           # the largest step the search considers (a prefill chunk above it is capped)
# Host ops, facts about the runtime's code (counted like planner.step_shape), paid at launch_us each:
STREAM_GROUP_OPS = 18       # one staging group (prefill_stream.run, _stage_store, store_stage.pack_into,
                            # kernels.qpn_moe): copy stream wait + DMA + record (3); side stream 2 waits,
                            # stage-pack launch, 2 records, global scales up (6); compute wait, x cast,
                            # output zero, route + gate/up + down launches, add, `free` record (8);
                            # the group's (slot, token, weight) views (1)
STREAM_LAYER_OPS = 5        # one streamed layer: the selection copied up, the output zeroed, 2 timing
                            # events, the add to the hits' sum
CPU_LAYER_OPS = 4           # one layer on the CPU runner: x cast + copy down, the sum copied up + added


@dataclass(frozen=True)
class _Layers:
    """The layers that can miss, as arrays [n, E] (n layers), with their card's figures [n]."""

    p: np.ndarray         # P(one token routes to e)
    b: np.ndarray         # stored bytes of e
    miss: np.ndarray      # bool: e is not in the card's slots
    h2d: np.ndarray       # bytes/s
    d2h: np.ndarray
    gpu: np.ndarray       # bytes/s the grouped kernel reads
    launch: np.ndarray    # us per host op
    weight: np.ndarray    # how many plan layers each row stands for


@dataclass(frozen=True)
class LayerCost:
    """Microseconds of one prefill step's MoE, summed over the plan's layers that can miss."""

    tokens: int
    cpu_us: float
    stream_us: float
    layers: int

    @property
    def streams(self) -> bool:
        return self.stream_us <= self.cpu_us


def m8_ratio(prof: HardwareProfile) -> tuple[float, str]:
    """(r8, where it comes from): the profile's cpu.nvfp4_m8_ratio, else DEFAULT_M8_RATIO."""
    f = prof.cpu.nvfp4_m8_ratio
    return (f.value, f.source) if f is not None else (DEFAULT_M8_RATIO, "default")


def call_cost(m, r8: float):
    """c(M): an M-row call's time over an M = 1 call's (module doc); m >= 1, an int or an array."""
    return 1.0 + max(0.0, r8 - 1.0) / 7.0 * (np.asarray(m, float) - 1.0)


def expected_call_cost(p: np.ndarray, tokens: int, r8: float) -> tuple[np.ndarray, np.ndarray]:
    """(E[c(M); M >= 1], P(M >= 1)) for M ~ Binomial(tokens, p), elementwise over p."""
    p = np.clip(np.asarray(p, float), 0.0, 1.0)
    touched = -np.expm1(tokens * np.log1p(-np.minimum(p, 1.0 - 1e-15)))      # 1 - (1 - p)^T
    touched = np.where(p >= 1.0, 1.0, touched)
    s = max(0.0, r8 - 1.0) / 7.0
    return (1.0 - s) * touched + s * tokens * p, touched


def _layers(mb: ModelBytes, prof: HardwareProfile, cards: tuple[CardPlan, ...], pop: Popularity | None) -> _Layers:
    """Each layer that can miss as a row; with uniform routing, equal layers of a card share one row."""
    cfg = mb.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    rows: dict = {}
    for c in cards:
        g = prof.gpus[c.device]
        figs = (g.h2d_gbs.value * 1e9, g.d2h_gbs.value * 1e9, g.kernel_bytes_per_s, g.launch_us.value)
        for layer, s in zip(range(*c.layers), c.slots_per_layer):
            if s >= E:
                continue                                       # resident: never misses, never streams
            b = np.asarray(mb.experts[layer], float)
            if pop is None:
                p = np.full(E, k / E)
                miss = np.arange(E) >= s                       # which ones does not matter: all alike
                key = (c.device, s, tuple(b))
            else:
                share = np.asarray(pop.layer(layer), float)
                p = np.minimum(1.0, k * share)
                miss = np.ones(E, bool)
                miss[np.argsort(-share, kind="stable")[:s]] = False   # the card holds its most chosen
                key = (c.device, layer)
            if key in rows:
                rows[key][-1] += 1
            else:
                rows[key] = [p, b, miss, *figs, 1]
    if not rows:
        z = np.zeros((0, E))
        return _Layers(z, z, z.astype(bool), *(np.zeros(0) for _ in range(5)))
    cols = list(zip(*rows.values()))
    return _Layers(*(np.array(c) for c in cols[:3]), *(np.array(c, float) for c in cols[3:]))


def step_cost(L: _Layers, tokens: int, hidden: int, prof: HardwareProfile, r8: float) -> LayerCost:
    """The module doc's cpu and stream times of a `tokens`-token prefill step, summed over L's layers."""
    if len(L.weight) == 0:
        return LayerCost(tokens, 0.0, 0.0, 0)
    cost, touched = expected_call_cost(L.p, tokens, r8)                        # [n, E]
    t1 = L.b / (prof.cpu.nvfp4_kernel_gbs.value * 1e9) * US                   # [n, E] us at M = 1
    hits = (np.where(L.miss, 0.0, touched * L.b).sum(-1)) / L.gpu * US        # [n]
    act = tokens * hidden * 4
    cpu_part = (prof.overheads.cpu_dispatch_us.value + CPU_LAYER_OPS * L.launch
                + act / L.d2h * US + act / L.h2d * US
                + np.where(L.miss, t1 * cost, 0.0).sum(-1))
    cpu = np.maximum(hits, cpu_part)
    u = np.where(L.miss, touched, 0.0).sum(-1)                                # [n] experts streamed
    dma = np.where(L.miss, touched * L.b, 0.0).sum(-1) / L.h2d * US
    host = np.ceil(u / PREFILL_STAGE_GROUP - 1e-9) * STREAM_GROUP_OPS * L.launch
    mean_b = np.where(L.miss, L.b, 0.0).sum(-1) / np.maximum(L.miss.sum(-1), 1)
    tail = np.minimum(u, PREFILL_STAGE_GROUP) * mean_b / L.gpu * US
    stream = hits + STREAM_LAYER_OPS * L.launch + np.maximum(dma, host) + tail
    return LayerCost(tokens, float((cpu * L.weight).sum()), float((stream * L.weight).sum()), int(L.weight.sum()))


def offload_min_tokens(mb: ModelBytes, prof: HardwareProfile, cards: tuple[CardPlan, ...], chunk: int,
                       pop: Popularity | None = None) -> tuple[int, LayerCost]:
    """(the smallest T in 1..chunk from which streaming a step's misses beats the CPU runner, summed
    over the plan's layers that can miss; 0 = never up to the chunk or nothing to stream) and the
    costs at that T (at the chunk when 0)."""
    L = _layers(mb, prof, cards, pop)
    r8, _ = m8_ratio(prof)
    top = max(1, min(chunk, SEARCH_MAX))
    at = lambda t: step_cost(L, t, mb.config.hidden_size, prof, r8)  # noqa: E731
    last = at(top)
    if last.layers == 0 or not last.streams:
        return 0, last
    lo, hi, best = 1, top, last                 # invariant: streaming wins at hi
    first = at(1)
    if first.streams:
        return 1, first
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = at(mid)
        if c.streams:
            hi, best = mid, c
        else:
            lo = mid
    return hi, best


def prefill_prediction(mb: ModelBytes, prof: HardwareProfile, cards: tuple[CardPlan, ...], chunk: int,
                       pop: Popularity | None = None, forced: int | None = None) -> PrefillPrediction:
    """The plan's prefill offload threshold: `forced` (--prefill-offload-min N) when given, else the
    model's (offload_min_tokens), with the costs that justify it."""
    model_min, cost = offload_min_tokens(mb, prof, cards, chunk, pop)
    r8, src = m8_ratio(prof)
    n = max(cost.layers, 1)
    return PrefillPrediction(offload_min=model_min if forced is None else int(forced), model_min=model_min,
                             forced=forced is not None, at_tokens=cost.tokens,
                             stream_us=cost.stream_us / n, cpu_us=cost.cpu_us / n, chunk=chunk,
                             layers=cost.layers, m8_ratio=r8, m8_source=src)


def prefill_lines(pre: PrefillPrediction | None) -> list[str]:
    """hybrid-plan's lines about prefill offload: the threshold and why."""
    if pre is None:
        return ["prefill offload: none (a CPU-only plan: no card to stream to)"]
    if pre.layers == 0:
        model = "every layer's experts are resident on its card: nothing to stream"
    else:
        r8 = f"CPU M = 8 call {pre.m8_ratio:.2f}x an M = 1 call ({pre.m8_source})"
        costs = (f"at {pre.at_tokens} tokens a layer that can miss streams its misses in "
                 f"{pre.stream_us / 1e3:.2f} ms vs {pre.cpu_us / 1e3:.2f} ms on the CPU ({pre.layers} such "
                 f"layers; {r8})")
        model = (f"from {pre.model_min} tokens: {costs}" if pre.model_min else
                 f"never up to the {pre.chunk}-token prefill chunk: {costs}")
    if pre.forced:
        what = (f"steps of >= {pre.offload_min} tokens stream" if pre.offload_min else "off")
        return [f"prefill offload: {what} (--prefill-offload-min {pre.offload_min}); the cost model's "
                f"threshold: {model}"]
    if pre.offload_min:
        return [f"prefill offload: steps of >= {pre.offload_min} tokens stream the experts their card "
                f"misses (cost model; --prefill-offload-min auto)", f"  {model}"]
    return ["prefill offload: off, no staging reserved (cost model; --prefill-offload-min auto)", f"  {model}"]

"""The Plan: what the runtime consumes (per card: device, layer range, cache slots, KV tokens)
plus the byte accounting and the prediction that justify it. Frozen; to_dict()/from_dict() round trip.

All sizes are bytes; times microseconds; bandwidths bytes/s.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True)
class CardPlan:
    """One logical card. layers = (start, stop): layers [start, stop) run here."""

    card: int                 # logical index (position in --gpus)
    device: int               # physical GPU index (profile / CUDA ordinal)
    name: str
    layers: tuple[int, int]
    kv_tokens: int
    kv_dtype: str
    slots: int                # expert-cache slots on this card
    slots_per_layer: tuple[int, ...]
    slot_bytes: int
    cap_bytes: int            # VRAM this card may use
    dense_bytes: int          # attention/norm/router weights (+ norm and head on the last; the embedding: host)
    kv_bytes: int
    workspace_bytes: int      # context + activations + graph reserve (see planner.memory)
    holds_head: bool

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.workspace_bytes + self.cache_bytes

    @property
    def free_bytes(self) -> int:
        return self.cap_bytes - self.used_bytes

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class HostPlan:
    expert_store_bytes: int   # every expert of every layer, packed (the CPU runner's arena)
    dense_bytes: int          # dense weights in host RAM: the embedding table; on CPU-only plans all of them
    kv_bytes: int             # KV cache in host RAM (CPU-only plans)
    reserve_bytes: int
    ram_cap_bytes: int
    hugepages_2m: int         # 2 MiB pages the expert arena needs
    hugepages_2m_reserved: int

    @property
    def used_bytes(self) -> int:
        return self.expert_store_bytes + self.dense_bytes + self.kv_bytes + self.reserve_bytes


@dataclass(frozen=True)
class LayerPrediction:
    layer: int
    card: int                 # -1: on the CPU
    slots: int
    hit_rate: float
    dense_us: float           # attention + router weights + KV read on the GPU
    gpu_experts_us: float     # hits through the grouped QPN kernel
    cpu_experts_us: float     # misses on the CPU incl. dispatch and activation transfers
    total_us: float           # dense + host + max(gpu_experts, cpu_experts) (resident: dense + gpu + host)
    host_us: float = 0.0      # host work: lookup (+ sync + eager ops where the layer can miss)
    kernel_us: float = 0.0    # of dense + gpu_experts: the fixed cost of the kernels, bytes aside
    resident: bool = False    # every expert in a slot: graphed with the dense part, no sync


@dataclass(frozen=True)
class Prediction:
    context: int              # tokens of context the prediction is for
    tok_s: float
    token_us: float
    hit_rate: float           # mean over layers
    gpu_bytes: int            # per token, read by GPU kernels
    cpu_bytes: int            # per token, expected expert bytes read by the CPU
    pcie_bytes: int           # per token: activations + card hops (excluding promotions)
    promotion_budget_bytes: int   # per token, what --pcie-frac allows for promotions
    layers: tuple[LayerPrediction, ...]
    host_us: float = 0.0      # per token, of token_us: host work (layers' lookups/syncs/eager ops + token_us)
    kernel_us: float = 0.0    # per token, of token_us: fixed per-kernel GPU cost (graph_kernel_us x kernels)
    hop_us: float = 0.0       # per token, of token_us: the crossings between physical GPUs (hidden state, sampled token)
    kv_us: float = 0.0        # per token of context, of token_us: every card layer's attention reading one more key

    def tok_s_at(self, context: int) -> float:
        """Predicted tok/s at another context with the same placement: token_us + (context - self.context) x
        kv_us (exact where the GPU part sets the token's time; with the overlapped decode bound by the
        host, the context costs less than this)."""
        return 1e6 / max(1e-9, self.token_us + (context - self.context) * self.kv_us)


@dataclass(frozen=True)
class PrefillPrediction:
    """Prefill offload (hybrid.runtime.prefill_stream): steps of >= offload_min tokens stream the
    experts their card misses instead of running them on the CPU (0 = never). The cost model's
    threshold and why (hybrid.planner.prefill): per layer that can miss, mean, at at_tokens (the
    threshold, or the chunk when streaming never wins up to it)."""

    offload_min: int          # what the session uses: model_min, or --prefill-offload-min N (forced)
    model_min: int            # the cost model's threshold; 0 = streaming never wins up to the chunk
    forced: bool              # offload_min was given, not the model's
    at_tokens: int
    stream_us: float          # streaming the layer's misses at at_tokens
    cpu_us: float             # the same misses on the CPU runner
    chunk: int                # the prefill chunk: the largest step
    layers: int               # layers that can miss (0: every layer resident, nothing to stream)
    m8_ratio: float           # the CPU's M = 8 call over an M = 1 call the model used
    m8_source: str            # measured | assumed (the profile's) | default (an older profile)


@dataclass(frozen=True)
class PlanInputs:
    model: str
    profile: str
    gpus: tuple[int, ...]
    layer_split: tuple[int, ...]  # card boundaries, e.g. (24,) for two cards
    kv_tokens: int
    kv_dtype: str
    cache_slots: tuple[int, ...] | None   # None = auto
    vram_cap_gib: tuple[float, ...] | None
    pcie_frac: float
    context: int
    prefill_chunk: int
    experts_profile: str | None
    bytes_source: str
    prefill_chunk_note: str = ""          # --prefill-chunk auto: why this chunk ("" when given)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    cards: tuple[CardPlan, ...]
    host: HostPlan
    prediction: Prediction
    warnings: tuple[str, ...] = ()
    prefill: PrefillPrediction | None = None    # None: a CPU-only plan (no card to stream to), older plans

    def card_of_layer(self, layer: int) -> CardPlan | None:
        for c in self.cards:
            if c.layers[0] <= layer < c.layers[1]:
                return c
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, cd in zip(self.cards, d["cards"]):
            cd.update(cache_bytes=c.cache_bytes, used_bytes=c.used_bytes, free_bytes=c.free_bytes)
        d["host"]["used_bytes"] = self.host.used_bytes
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        p = d["prediction"]
        return cls(
            inputs=_make(PlanInputs, d["inputs"]),
            cards=tuple(_make(CardPlan, c) for c in d["cards"]),
            host=_make(HostPlan, d["host"]),
            prediction=_make(Prediction, {**p, "layers": tuple(_make(LayerPrediction, x) for x in p["layers"])}),
            warnings=tuple(d.get("warnings", ())),
            prefill=_make(PrefillPrediction, d["prefill"]) if d.get("prefill") else None,
        )


def _make(cls, d: dict):
    """cls from a dict, ignoring derived keys, defaulting keys that older plans lack, and turning
    lists back into tuples."""
    kw = {}
    for f in fields(cls):
        if f.name not in d and f.default is not MISSING:
            continue
        v = d[f.name]
        kw[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kw)

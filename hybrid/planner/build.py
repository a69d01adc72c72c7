"""Make a Plan: hardware profile + model bytes + request -> per-card placement, host needs, prediction.

Layers [0, s1) go to card 0, [s1, s2) to card 1, ... (s = the layer split). A plan that does not
fit raises PlanError naming the card (or the host), what it holds and by how much it overflows.
The plan's prefill offload threshold (hybrid.planner.prefill) is worked out once, for the plan
returned: not for each split that --layer-split auto tries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybrid.errors import PlanError
from hybrid.planner.memory import GIB, KV_DTYPES, MIB, gib, kv_bytes, prefill_stage_bytes, workspace_bytes
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import CardPlan, HostPlan, Plan, PlanInputs
from hybrid.planner.popularity import Popularity, allot_slots
from hybrid.planner.predict import predict
from hybrid.planner.prefill import prefill_prediction
from hybrid.planner.profile import HardwareProfile

HUGEPAGE = 2 * MIB
MAX_PCIE_FRAC = 0.9


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for (the flags of hybrid-plan / hybrid-run). Validates itself.

    gpus: profile GPU index per logical card (repeat an index for logical cards on one GPU);
    layer_split: card boundaries, None = auto; cache_slots: per card, None = auto (fill);
    vram_cap_gib: per card, None = the GPU's memory shared evenly among its logical cards;
    prefill_stage: experts per prefill staging group each card reserves room for (hybrid-run's
    prefill offload; 0 = none reserved, planner.memory.prefill_stage_bytes), counted in workspace;
    prefill_offload_min: prefill steps of >= this many tokens stream their misses (0 = never); None =
    auto: the cost model's threshold (hybrid.planner.prefill), and then prefill_stage is reserved
    only where the model streams at all (a plan whose model says never gives the room to slots);
    overlap: the decode loop runs a step whose layers are all resident ahead of the host's work for
    the step before (hybrid.generate's overlapped decode): such a token costs max(GPU, host), not
    their sum (planner.predict).
    """

    gpus: tuple[int, ...]
    layer_split: tuple[int, ...] | None = None
    kv_tokens: int = 4096
    kv_dtype: str = "fp16"
    cache_slots: tuple[int, ...] | None = None
    vram_cap_gib: tuple[float, ...] | None = None
    pcie_frac: float = 0.1
    context: int = 1024
    prefill_chunk: int | None = 512         # None: auto (the largest of AUTO_CHUNKS that costs few slots)
    prefill_stage: int = 0
    prefill_offload_min: int | None = None
    overlap: bool = False

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if self.kv_dtype not in KV_DTYPES:
            raise PlanError(f"--kv-dtype {self.kv_dtype}: expected one of {', '.join(KV_DTYPES)}")
        if self.prefill_stage < 0:
            raise PlanError(f"prefill staging group must be >= 0 experts, got {self.prefill_stage}")
        m = self.prefill_offload_min
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise PlanError(f"--prefill-offload-min {m}: expected auto or a token count >= 0 (0 = off)")
        if self.kv_tokens < 0 or self.context < 0 or (self.prefill_chunk is not None and self.prefill_chunk <= 0):
            raise PlanError("--kv-resident and --context must be >= 0, --prefill-chunk > 0")
        if not 0.0 <= self.pcie_frac <= MAX_PCIE_FRAC:
            raise PlanError(f"--pcie-frac {self.pcie_frac}: expected a fraction in [0, {MAX_PCIE_FRAC}] "
                            f"(the rest of the link carries activations)")
        if any(g < 0 for g in self.gpus):
            raise PlanError(f"--gpus: indices must be >= 0, got {list(self.gpus)}")
        for flag, v in (("--layer-split", self.layer_split), ("--cache-slots", self.cache_slots),
                        ("--vram-cap", self.vram_cap_gib)):
            if v is not None and flag != "--layer-split" and len(v) not in (1, n):
                raise PlanError(f"{flag}: give one value or one per card ({n}), got {len(v)}")
        if self.layer_split is not None and len(self.layer_split) != max(n - 1, 0):
            raise PlanError(f"--layer-split: {n} cards need {max(n - 1, 0)} boundaries, "
                            f"got {len(self.layer_split)}")
        if self.cache_slots is not None and any(s < 0 for s in self.cache_slots):
            raise PlanError("--cache-slots must be >= 0")
        if self.vram_cap_gib is not None and any(v <= 0 for v in self.vram_cap_gib):
            raise PlanError("--vram-cap must be > 0")

    def per_card(self, values, i):
        return None if values is None else values[i if len(values) > 1 else 0]


# --prefill-chunk auto: the chunks tried, largest first, above BASE_CHUNK (the workspace every plan has).
# A prompt prefilled in larger steps streams each missed expert once per step instead of once per 512
# tokens and, with every expert resident, runs fewer and fuller grouped GEMMs (H200, 30B-A3B: 2048 tokens in
# one step 62 ms vs 88-94 in graphed chunks of 512; a 4096-token step 129 ms vs 142 in two of 2048, 8192
# tokens 304 vs 332; experts on the CPU, 8192 tokens 7,978 vs 5,152 tok/s; results/runtime.md §22-25).
BASE_CHUNK = 512
AUTO_CHUNKS = (4096, 2048, 1024)
AUTO_CHUNK_SLOT_LOSS = 0.02   # a larger chunk's workspace may cost a card at most this share of its slots
                              # (a card holding all its layers' experts must keep holding them all)


def make_plan(mb: ModelBytes, prof: HardwareProfile, req: PlanRequest, pop: Popularity | None = None,
              model: str = "", experts_path: str | None = None) -> Plan:
    """The plan for req.layer_split (None: the best split, search.best_plan), with its prefill
    offload threshold; req.prefill_chunk None: the chunk too (auto_chunk)."""
    if req.prefill_chunk is None:
        return auto_chunk(mb, prof, req, pop, model, experts_path)
    if req.layer_split is None:               # every candidate planned in full, as below (prefill included)
        from hybrid.planner.search import best_plan

        return best_plan(mb, prof, req, pop, model, experts_path)
    return _with_prefill(_placement(mb, prof, req, pop, model, experts_path), mb, prof, req, pop, model, experts_path)


def auto_chunk(mb: ModelBytes, prof: HardwareProfile, req: PlanRequest, pop: Popularity | None = None,
               model: str = "", experts_path: str | None = None) -> Plan:
    """The plan with the largest prefill chunk of AUTO_CHUNKS whose workspace costs no card more than
    AUTO_CHUNK_SLOT_LOSS of the expert slots it has at BASE_CHUNK (on the same layer split; a card
    holding every expert of its layers keeps them all), else the BASE_CHUNK plan. A CPU-only plan keeps
    BASE_CHUNK (no workspace to size)."""
    base = make_plan(mb, prof, replace(req, prefill_chunk=BASE_CHUNK), pop, model, experts_path)
    if not base.cards:
        return _noted(base, "auto: no card")
    fixed = replace(req, layer_split=base.inputs.layer_split)
    why = []
    for chunk in AUTO_CHUNKS:
        try:
            plan = make_plan(mb, prof, replace(fixed, prefill_chunk=chunk), pop, model, experts_path)
        except PlanError:
            why.append(f"{chunk} does not fit")
            continue
        lost = [(a.card, a.slots - b.slots) for a, b in zip(base.cards, plan.cards)
                if not _keeps_slots(a, b, mb.config.num_experts)]
        if not lost:
            fewer = sum(a.slots for a in base.cards) - sum(b.slots for b in plan.cards)
            note = f"{fewer} fewer expert slots than at {BASE_CHUNK}" if fewer else "no expert slot lost"
            return _noted(plan, "auto: " + "; ".join([note, *why]))
        card, n = lost[0]
        why.append(f"{chunk} would cost card {card} {n} of its {base.cards[card].slots} slots")
    return _noted(base, "auto: " + "; ".join(why))


def _noted(plan: Plan, note: str) -> Plan:
    return replace(plan, inputs=replace(plan.inputs, prefill_chunk_note=note))


def _keeps_slots(base: CardPlan, other: CardPlan, experts: int) -> bool:
    total = (base.layers[1] - base.layers[0]) * experts
    if base.slots >= total:
        return other.slots >= total
    return other.slots >= base.slots * (1 - AUTO_CHUNK_SLOT_LOSS)


def _with_prefill(plan: Plan, mb: ModelBytes, prof: HardwareProfile, req: PlanRequest,
                  pop: Popularity | None, model: str, experts_path: str | None) -> Plan:
    """plan with its prefill offload threshold; auto with a model that never streams: the staging
    reservation goes back to the cache slots (placed again without it)."""
    if not plan.cards:
        return plan                           # CPU only: no card to stream to
    pre = prefill_prediction(mb, prof, plan.cards, req.prefill_chunk, pop, req.prefill_offload_min)
    if req.prefill_offload_min is None and pre.offload_min == 0 and req.prefill_stage:
        bare = _placement(mb, prof, replace(req, prefill_stage=0), pop, model, experts_path)
        again = prefill_prediction(mb, prof, bare.cards, req.prefill_chunk, pop, None)
        if again.offload_min == 0:            # (more slots streaming after all: keep the room, unused)
            plan, pre = bare, again
    return replace(plan, prefill=pre)


def _placement(mb: ModelBytes, prof: HardwareProfile, req: PlanRequest, pop: Popularity | None = None,
               model: str = "", experts_path: str | None = None) -> Plan:
    """Cards, host and decode prediction for req.layer_split (set)."""
    cfg = mb.config
    ranges = layer_ranges(cfg.num_hidden_layers, req.layer_split, len(req.gpus))
    caps = card_caps(prof, req)
    warnings: list[str] = []
    cards = tuple(_card(mb, prof, req, i, r, caps[i], pop, warnings) for i, r in enumerate(ranges))
    host = _host(mb, prof, req, bool(cards), warnings)
    hits = _hit_rates(mb, cards, pop)
    pred = predict(mb, prof, cards, hits, req)
    inputs = PlanInputs(model=model, profile=prof.name, gpus=req.gpus, layer_split=req.layer_split,
                        kv_tokens=req.kv_tokens, kv_dtype=req.kv_dtype, cache_slots=req.cache_slots,
                        vram_cap_gib=req.vram_cap_gib, pcie_frac=req.pcie_frac, context=req.context,
                        prefill_chunk=req.prefill_chunk, experts_profile=experts_path,
                        bytes_source=mb.source)
    return Plan(inputs, cards, host, pred, tuple(warnings))


def layer_ranges(num_layers: int, split: tuple[int, ...], cards: int) -> list[range]:
    """[0, s1), [s1, s2), ..., [s_last, L); every card gets at least one layer."""
    if cards == 0:
        return []
    bounds = (0, *split, num_layers)
    if any(b >= a2 for b, a2 in zip(bounds, bounds[1:])):
        raise PlanError(f"--layer-split {','.join(map(str, split))}: boundaries must increase "
                        f"strictly within 1..{num_layers - 1} so each card holds a layer")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def card_caps(prof: HardwareProfile, req: PlanRequest) -> list[int]:
    """VRAM bytes each logical card may use; checks the caps sharing a GPU fit in it."""
    caps = []
    for i, g in enumerate(req.gpus):
        if g >= len(prof.gpus):
            raise PlanError(f"--gpus {g}: profile {prof.name} has {len(prof.gpus)} GPU(s) "
                            f"(indices 0..{len(prof.gpus) - 1})")
        share = req.gpus.count(g)
        cap = req.per_card(req.vram_cap_gib, i)
        caps.append(prof.gpus[g].memory_bytes // share if cap is None else int(cap * GIB))
    for g in set(req.gpus):
        asked = sum(c for c, gg in zip(caps, req.gpus) if gg == g)
        have = prof.gpus[g].memory_bytes
        if asked > have:
            raise PlanError(f"--vram-cap: the card(s) on GPU {g} ({_short(prof.gpus[g].name)}) ask "
                            f"{gib(asked)} but it has {gib(have)}")
    return caps


def _card(mb: ModelBytes, prof: HardwareProfile, req: PlanRequest, i: int, layers: range,
          cap: int, pop: Popularity | None, warnings: list[str]) -> CardPlan:
    cfg, g = mb.config, req.gpus[i]
    gpu = prof.gpus[g]
    last = i == len(req.gpus) - 1
    dense = sum(mb.layer_dense[layers.start:layers.stop])
    if last:                     # the embedding stays on the host (hybrid.runtime.host_embed); a tied head is a copy
        dense += mb.final_norm + mb.head_bytes
    kv = kv_bytes(cfg, req.kv_tokens, len(layers), req.kv_dtype)
    ctx = int(gpu.context_mib.value * MIB) if req.gpus.index(g) == i else 0
    ws = workspace_bytes(cfg, req.prefill_chunk, ctx, last) + prefill_stage_bytes(mb.slot_bytes, req.prefill_stage)
    parts = [("dense", dense), ("KV", kv), ("workspace", ws)]
    n_exp, slot = len(layers) * cfg.num_experts, mb.slot_bytes
    want = req.per_card(req.cache_slots, i)
    if want is None:
        slots = max(0, min((cap - dense - kv - ws) // slot, n_exp))
    else:
        if want > n_exp:
            warnings.append(f"card {i}: --cache-slots {want} > its {n_exp} experts; using {n_exp}")
        slots = min(want, n_exp)
        parts.append((f"expert cache ({slots} x {slot / MIB:.2f} MiB)", slots * slot))
    _check_fits(f"card {i} ({_short(gpu.name)}, cap {gib(cap)})", parts, cap)
    per_layer, _ = allot_slots(layers, slots, cfg.num_experts, pop)
    return CardPlan(card=i, device=g, name=gpu.name, layers=(layers.start, layers.stop),
                    kv_tokens=req.kv_tokens, kv_dtype=req.kv_dtype, slots=slots,
                    slots_per_layer=per_layer, slot_bytes=slot, cap_bytes=cap, dense_bytes=dense,
                    kv_bytes=kv, workspace_bytes=ws, holds_head=last)


def _host(mb: ModelBytes, prof: HardwareProfile, req: PlanRequest, has_cards: bool,
          warnings: list[str]) -> HostPlan:
    """All experts live in the host arena; the embedding table too (hybrid.runtime.host_embed); on a CPU-only plan
    every dense weight and the KV."""
    store = mb.expert_store
    dense = mb.embed if has_cards else mb.total - store
    kv = 0 if has_cards else kv_bytes(mb.config, req.kv_tokens, mb.config.num_hidden_layers, req.kv_dtype)
    reserve = int(prof.host.reserve_gib * GIB)
    cap = int(prof.host.ram_usable_gib * GIB)
    parts = [("expert store", store)] + ([("embedding", dense)] if has_cards else [("dense", dense), ("KV", kv)]) \
        + [("reserve", reserve)]
    _check_fits(f"host ({gib(cap)} usable RAM)", parts, cap)
    pages, have = math.ceil(store / HUGEPAGE), prof.host.hugepages_2m_total
    if have < pages:
        warnings.append(f"host: the expert store needs {pages} 2 MiB hugepages, {have} reserved; it "
                        f"falls back to transparent hugepages (reserve: sudo sysctl vm.nr_hugepages={pages})")
    return HostPlan(expert_store_bytes=store, dense_bytes=dense, kv_bytes=kv, reserve_bytes=reserve, ram_cap_bytes=cap,
                    hugepages_2m=pages, hugepages_2m_reserved=have)


def _check_fits(where: str, parts: list[tuple[str, int]], cap: int) -> None:
    total = sum(b for _, b in parts)
    if total > cap:
        terms = " + ".join(f"{what} {gib(b)}" for what, b in parts)
        raise PlanError(f"{where}: {terms} = {gib(total)} exceeds {gib(cap)} by {gib(total - cap)}")


def _hit_rates(mb: ModelBytes, cards: tuple[CardPlan, ...], pop: Popularity | None) -> list[float]:
    """Expected hit rate per layer (0 for layers on no card)."""
    hits = [0.0] * mb.config.num_hidden_layers
    for c in cards:
        layers = range(*c.layers)
        _, rates = allot_slots(layers, c.slots, mb.config.num_experts, pop)
        for layer, h in zip(layers, rates):
            hits[layer] = h
    return hits


def _short(name: str) -> str:
    for prefix in ("Tesla ", "NVIDIA "):
        if name.startswith(prefix) and len(name) > len(prefix) + 4:
            return name[len(prefix):]
    return name

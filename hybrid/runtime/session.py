"""open_session: hybrid-run flags (+ a planner Plan when a hardware profile is known) -> a running
hybrid model: layer_devices from the placement, dense weights per card, one ExpertCache + slot
storage per card, the CPU runner over every expert, stats and an optional routing trace."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid.errors import HybridError
from hybrid.experts.cache import ExpertCache
from hybrid.experts.policy import make_policy
from hybrid.experts.popularity import ExpertProfile, load_profile as load_expert_profile
from hybrid.experts.trace import TraceHeader, TraceWriter
from hybrid.hardware import require_gpus
from hybrid.kernels.driver import carveout
from hybrid.kernels.fused import attn_w_per_sm, route_rank
from hybrid.kernels.qpn import moe_gemm_mode, moe_mt2, moe_reduce, seq_mode, tb_mode
from hybrid.model.config import ModelConfig
from hybrid.model.layers import sdpa_gqa_mode
from hybrid.runtime.cpu_card import hold_dense
from hybrid.runtime.cpu_side import make_cpu_runner
from hybrid.runtime.store_stage import promote_mode, source_mode, stage_kernel_enabled
from hybrid.runtime.hybrid_experts import CardRuntime, HybridExperts
from hybrid.runtime.hybrid_model import HybridModel
from hybrid.runtime.options import RuntimeOptions
from hybrid.runtime.placement import Placement
from hybrid.runtime.routing_counts import RoutingCounter, Tee, check_writable, command_line
from hybrid.runtime.routing_counts import save as save_counts
from hybrid.runtime.slots import CardSlots
from hybrid.runtime.stats import RuntimeStats, summary_lines

log = logging.getLogger("hybrid.runtime")


@dataclass
class Session:
    model: HybridModel
    placement: Placement
    plan: object
    cards: list[CardRuntime]
    cpu: object
    stats: RuntimeStats
    opts: RuntimeOptions
    trace: TraceWriter | None = None
    expert_profile: ExpertProfile | None = None
    load_s: dict = field(default_factory=dict)
    owns_cpu: bool = True
    dense_held: int = 0                  # CPU cards: fp32 bytes of dense weights held (cpu_card)
    counter: RoutingCounter | None = None  # --save-expert-profile: the run's routing counts
    model_id: tuple[str, str] = ("", "")   # (model folder name, model_type) for the saved profile
    saved_profile: Path | None = None      # where close() wrote them

    @property
    def caches(self) -> list[ExpertCache]:
        return [c.cache for c in self.cards]

    @property
    def prefill_chunk(self) -> int:
        """0 = the whole prompt at once."""
        return self._prefill_chunk()[0]

    def _prefill_chunk(self) -> tuple[int, str]:
        """(prefill chunk, where it comes from): --prefill-chunk, else the plan's, else the whole prompt (0)."""
        if self.opts.prefill_chunk is not None:
            return self.opts.prefill_chunk, "--prefill-chunk"
        if self.plan is not None:
            return self.plan.inputs.prefill_chunk, "plan"
        return 0, "whole prompt"

    def report(self, measured_tok_s: float | None = None) -> dict:
        d = self.stats.to_dict(self.caches, self.plan, measured_tok_s)
        d["placement"] = self.placement.describe()
        d["slot_storage"] = sorted({k for c in self.cards for k in c.slots.kinds})
        d["cpu_runner"] = type(self.cpu).__name__
        d["load_s"] = {k: round(v, 3) for k, v in self.load_s.items()}
        d["cpu_dense_held_bytes"] = self.dense_held
        d["prefill_stream"] = self.model.experts.prefill_stream_stats()
        d["prefill_stream"]["source"] = self._prefill_source()
        d["prefill_stream"]["offload_min"] = self.model.experts.prefill_min
        d["prefill_graphs"] = ({"steps": pg.steps, "captures": pg.captures, "error": pg.error}
                               if (pg := self.model.prefill_graphs) is not None else None)
        d["prefill_chunk"] = dict(zip(("tokens", "source"), self._prefill_chunk()))
        d["warm_start"] = self._warm_start()
        if self.saved_profile is not None:
            d["expert_profile_saved"] = str(self.saved_profile)
        return d

    def _warm_start(self) -> dict:
        """What the slots held at load (--cache-warm): experts placed, of how many slots, and from where."""
        n = sum(len(v) for c in self.caches for v in c.warm.values())
        src = ("none" if not n else "expert profile" if self.expert_profile is not None else "id order")
        return {"experts": n, "slots": sum(c.spec.slots for c in self.cards), "source": src,
                "mode": self.opts.cache_warm}

    def _prefill_source(self) -> str | None:
        """Where prefill offload reads streamed experts: 'store' (the pinned CPU store), 'checkpoint',
        or None when the session does not stream (offload off, or no CUDA card)."""
        ex = self.model.experts
        if not ex.prefill_min or not any(c.device.type == "cuda" for c in self.cards):
            return None
        return source_mode() if ex.store_source is not None else "checkpoint"

    def summary(self, measured_tok_s: float | None = None) -> list[str]:
        rep = self.report(measured_tok_s)
        ps = rep["prefill_stream"]
        extra = [f"prefill offload (steps of >= {ps['offload_min']} tokens): {ps['experts']} experts streamed to the "
                 f"cards from the {ps['source'] or 'checkpoint'} ({ps['bytes'] / 2**20:.1f} MiB, {ps['groups']} groups, "
                 f"{ps['layers']} layer passes)"] if ps["experts"] else []
        ch = rep["prefill_chunk"]
        extra.append(f"prefill chunk: {ch['tokens'] or 'the whole prompt'}"
                     + (f" tokens ({ch['source']})" if ch["tokens"] else ""))
        ws = rep["warm_start"]
        extra.append(f"warm start (--cache-warm {ws['mode']}): {ws['experts']} of {ws['slots']} slots filled at load"
                     + (f" ({ws['source']})" if ws["experts"] else ""))
        pg = rep["prefill_graphs"]
        if pg and pg["steps"]:
            extra.append(f"prefill graphs: {pg['steps']} prompt(s) replayed, {pg['captures']} bucket(s) captured")
        return [self.placement.describe()] + summary_lines(rep) + extra

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        try:
            if self.counter is not None:             # --save-expert-profile: once, at the first close
                counter, self.counter = self.counter, None
                self.saved_profile = save_counts(counter, self.opts.save_expert_profile, *self.model_id,
                                                 command_line())
        finally:
            if self.owns_cpu:
                self.cpu.close()


def open_session(path: str | Path, opts: RuntimeOptions, context: int = 1024, meta: dict | None = None,
                 progress: bool = False, cpu=None) -> Session:
    """Load the model at `path` for hybrid decoding as `opts` asks. context: tokens the planner
    predicts for; cpu: a CPU runner of an earlier session of the same model to reuse (not closed here)."""
    from hybrid.model.loader import load_model

    path = Path(path)
    cfg = ModelConfig.from_folder(path)
    _check_devices(opts)
    if opts.save_expert_profile:
        check_writable(opts.save_expert_profile)     # before minutes of loading
    t0 = time.perf_counter()
    hw = _hardware_profile(opts)
    eprof, eprof_path = _expert_profile(path, opts, cfg, strict=hw is not None)
    plan = _plan(path, cfg, opts, hw, eprof, eprof_path, context)
    placement = (Placement.from_plan(plan, opts.device, cfg.num_experts) if plan is not None else
                 Placement.manual(cfg.num_hidden_layers, cfg.num_experts, opts.gpus, opts.device,
                                  opts.layer_split, opts.cache_slots))
    t1 = time.perf_counter()
    model = load_model(path, device=placement.cards[0].device, layer_devices=placement.layer_devices(),
                       lm_head=opts.lm_head)
    held = hold_dense(model)                  # CPU cards: dense weights decoded once, not per call
    t2 = time.perf_counter()
    ws = model.weights
    get_expert = ws.expert_weights
    first = [get_expert(l, 0) for l in range(cfg.num_hidden_layers)]
    qtypes = {l: w[0].qtype for l, w in enumerate(first)}
    bytes_per_expert = max(sum(q.nbytes for q in w) for w in first)
    # promotions per step within --pcie-frac of the plan's link; without a plan no link to take a share of,
    # but --pcie-frac 0 still means none
    budget = plan.prediction.promotion_budget_bytes if plan is not None else (0 if opts.pcie_frac == 0 else None)
    t3 = time.perf_counter()
    owns_cpu = cpu is None
    if owns_cpu:                              # before the cards: their slots can be filled from its store
        cpu = make_cpu_runner(cfg, get_expert, qtypes[0], opts.cpu_engine, opts.cpu_threads,
                              opts.hugepages, progress)
    t4 = time.perf_counter()
    source = fill_from = None
    offload_min = opts.offload_min_for(plan)  # the flag, the plan's cost model, or the default
    if any(c.device.startswith("cuda") for c in placement.cards):
        source_mode()                         # a bad HYBRID_PREFILL_SOURCE / _PROMOTE_SOURCE /
        stage_kernel_enabled()                # _STAGE_KERNEL / HYBRID_MOE_GEMM / HYBRID_SDPA_GQA /
        moe_gemm_mode()                       # HYBRID_SMEM_CARVEOUT / HYBRID_ATT_W_PER_SM /
        sdpa_gqa_mode()                       # HYBRID_ROUTE_RANK / HYBRID_QPN_TB /
        carveout(None)                        # HYBRID_QPN_SEQ / HYBRID_MOE_REDUCE / _MOE_MT2: one line, now
        attn_w_per_sm()
        route_rank()
        tb_mode()
        seq_mode()
        moe_reduce()
        moe_mt2()
        from_store = promote_mode() == "store" and any(c.slots for c in placement.cards)   # slots to fill
        if hasattr(cpu, "store_source") and (offload_min or from_store):
            source = cpu.store_source()       # prefill offload / promotions read the pinned store
        fill_from = source if from_store else None
    t5 = time.perf_counter()
    cards = [_card(spec, cfg, opts, eprof, qtypes, bytes_per_expert, budget, get_expert, fill_from)
             for spec in placement.cards]
    t6 = time.perf_counter()
    stats = RuntimeStats(cfg.num_hidden_layers)
    counter = (RoutingCounter(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok)
               if opts.save_expert_profile else None)
    trace = _trace(opts, path, cfg, cards, placement, meta, counter)
    experts = HybridExperts(cards, cpu, get_expert, cfg.num_hidden_layers, stats, trace,
                            prefill_min=offload_min, store_source=source)
    model.experts = experts
    graphs = prefill_graphs = None
    if placement.cards[0].device.startswith("cuda"):
        from hybrid.generate import overlap_enabled
        from hybrid.runtime.graphs import DecodeGraphs
        from hybrid.runtime.prefill_graphs import PrefillGraphs

        model.kv_reserve = opts.kv_resident or context     # one KV store for every generation
        graphs = DecodeGraphs(model, experts)
        prefill_graphs = PrefillGraphs(model, experts)
        if overlap_enabled():                 # the overlapped decode's table now, not at its second token
            graphs.pin_embed()
    t7 = time.perf_counter()
    hm = HybridModel(model, experts, opts.kv_resident, opts.kv_dtype, graphs, prefill_graphs)
    return Session(hm, placement, plan, cards, cpu, stats, opts, trace, eprof,
                   {"plan": t1 - t0, "dense": t2 - t1, "cpu_store": t4 - t3, "pin_store": t5 - t4,
                    "expert_cache": t6 - t5, "embed": t7 - t6},
                   owns_cpu, held, counter, (path.resolve().name, cfg.model_type))


def _check_devices(opts: RuntimeOptions) -> None:
    if opts.device == "cuda":
        require_gpus("--device cuda", opts.gpus, f"--gpus {','.join(map(str, opts.gpus))}")


def _expert_profile(path: Path, opts: RuntimeOptions, cfg: ModelConfig, strict: bool):
    """--expert-profile FILE, else profiles/<folder>.experts.json if there is one; read once, strictly
    (the planner's checks) when a plan will be made from it."""
    from hybrid.planner.popularity import find_popularity

    p = Path(opts.expert_profile) if opts.expert_profile else find_popularity(path)
    if p is None:
        if opts.policy == "static":
            raise HybridError("--cache-policy static needs an expert profile (--expert-profile FILE "
                              "or profiles/<model>.experts.json from hybrid-profile)")
        return None, None
    prof = load_expert_profile(p, cfg if strict else None)
    if (prof.num_layers, prof.num_experts) != (cfg.num_hidden_layers, cfg.num_experts):
        raise HybridError(f"{p}: expert profile is for {prof.num_layers} layers x {prof.num_experts} "
                          f"experts; the model has {cfg.num_hidden_layers} x {cfg.num_experts}")
    return prof, p


def _plan(path: Path, cfg: ModelConfig, opts: RuntimeOptions, prof, eprof: ExpertProfile | None,
          eprof_path, context: int):
    """A planner Plan when a hardware profile `prof` is known (_hardware_profile); else None."""
    from hybrid.generate import overlap_enabled
    from hybrid.planner import ModelBytes, PlanRequest, Popularity, make_plan
    from hybrid.planner.memory import PREFILL_STAGE_GROUP

    if prof is None:
        return None
    pop = Popularity.from_profile(eprof, str(eprof_path)) if eprof is not None else None
    req = PlanRequest(gpus=tuple(opts.gpus), layer_split=opts.layer_split,
                      kv_tokens=opts.kv_resident or max(context, 1), kv_dtype=opts.kv_dtype,
                      cache_slots=opts.cache_slots, vram_cap_gib=opts.vram_cap_gib,
                      pcie_frac=min(opts.pcie_frac, 0.9), context=context,
                      prefill_chunk=opts.prefill_chunk,                     # None: the planner's auto chunk
                      prefill_stage=PREFILL_STAGE_GROUP if opts.offload_min else 0,
                      prefill_offload_min=opts.prefill_offload_min,          # None: the cost model's
                      overlap=opts.device == "cuda" and overlap_enabled())   # what generate() does by default
    return make_plan(ModelBytes.from_folder(path).with_head(opts.lm_head), prof, req, pop, model=path.resolve().name,
                     experts_path=None if eprof_path is None else str(eprof_path))


def _hardware_profile(opts: RuntimeOptions):
    """--profile, else (on CUDA) the first shipped profile whose GPU is the one visible, else None."""
    from hybrid.planner import list_profiles, load_profile

    if opts.profile:
        return load_profile(opts.profile)
    if opts.device != "cuda":
        return None
    name = torch.cuda.get_device_name(opts.gpus[0])
    for cand in list_profiles():
        try:
            prof = load_profile(cand)
        except HybridError:
            continue
        if prof.gpus and all(g < len(prof.gpus) and prof.gpus[g].name == name for g in set(opts.gpus)):
            return prof
    return _adapted_profile(opts)


def _adapted_profile(opts: RuntimeOptions):
    """No shipped profile names the visible GPU: the nearest one's speed figures with this machine's GPUs
    (CUDA ordinals up to the last in --gpus), RAM and CPU, so the plan's slots and KV fit the cards (without a
    plan, half of every card's experts would get slots, whatever its memory). One log line says so."""
    from hybrid.hardware import detect_cpu, detect_memory
    from hybrid.planner import list_profiles, load_profile
    from hybrid.planner.profile import adapt_profile, nearest_profile

    profs = []
    for cand in list_profiles():
        try:
            profs.append(load_profile(cand))
        except HybridError:
            continue
    props = [torch.cuda.get_device_properties(i) for i in range(max(opts.gpus) + 1)]
    cc = [f"{p.major}.{p.minor}" for p in props]
    base = nearest_profile(profs, cc[opts.gpus[0]], len(set(opts.gpus)))
    if base is None:
        return None
    cpu, mem = detect_cpu(), detect_memory()
    huge = mem.hugepages_total if mem.hugepage_size_bytes == 2 * 2**20 else 0
    prof = adapt_profile(base, [(p.name, c, p.total_memory // 2**20) for p, c in zip(props, cc)],
                         mem.available_bytes / 2**30, cpu.model, cpu.physical_cores, cpu.avx2, cpu.avx512, huge)
    log.warning("hardware profile: none shipped for %s; planning with %s's speed figures and this machine's "
                "sizes (predictions are %s's; hybrid-bench calibrate --out profiles/NAME.json measures this "
                "machine, then --profile NAME)", props[opts.gpus[0]].name, base.name, base.name)
    return prof


def _card(spec, cfg, opts, eprof, qtypes, bytes_per_expert, budget, get_expert, source=None) -> CardRuntime:
    """One card's expert cache and slots, its warm-start residents (--cache-warm: the expert profile's most used,
    else with auto experts in id order until the slots are full) loaded: from the pinned CPU store
    (source: what promotions read too; no checkpoint read, no host copy) where the layer's slots are
    packed storage of the store's weight type, else from the checkpoint."""
    policy = make_policy(opts.policy, profile=eprof)
    cache = ExpertCache(list(spec.layer_ids), list(spec.slots_per_layer), cfg.num_experts, policy,
                        bytes_per_expert=bytes_per_expert, budget_bytes=budget)
    if eprof is not None and opts.cache_warm != "off":
        cache.warm_from_profile(eprof)
    elif eprof is not None:
        cache.seed(eprof)                           # the policy's state only, the slots left empty
    elif opts.cache_warm == "auto":                 # no profile: the slots are not left empty
        cache.warm_start({l: range(cfg.num_experts) for l in spec.layer_ids})
    layer_slots = {l: (cache.slot_range(l).start, len(cache.slot_range(l))) for l in spec.layer_ids}
    slots = CardSlots(torch.device(spec.device), layer_slots, {l: qtypes[l] for l in spec.layer_ids},
                      cfg.hidden_size, cfg.moe_intermediate_size)
    for l in spec.layer_ids:
        packed = source.target(slots, l) if source is not None else None
        for e, s in cache.residents(l).items():
            if packed is not None:
                source.load_slot(packed, slots.local(l, s), l, e)
            else:
                slots.load(l, s, get_expert(l, e))
    dev = torch.device(spec.device)
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    card = CardRuntime(spec, cache, slots, stream)
    for l in spec.layer_ids:
        card.refresh(l)
    return card


def _trace(opts, path, cfg, cards, placement, meta, counter=None):
    """The step sink HybridExperts writes each step's routing to: the --trace writer, the routing counter of
    --save-expert-profile, both (Tee), or None."""
    writer = None
    if opts.trace:
        header = TraceHeader(path.resolve().name, cfg.num_hidden_layers, cfg.num_experts,
                             cfg.num_experts_per_tok, [c.cache.describe() for c in cards],
                             {**(meta or {}), "placement": placement.describe()})
        try:
            writer = TraceWriter(opts.trace, header)
        except OSError as exc:
            raise HybridError(f"--trace {opts.trace}: cannot write ({exc.strerror})") from None
    if writer is not None and counter is not None:
        return Tee(writer, counter)
    return writer if writer is not None else counter

"""HybridExperts: the ExpertExecutor that splits each MoE layer between a card's expert cache and
the CPU runner.

Legend: T tokens, H hidden, k experts per token, A (token, expert) pairs.
Per layer (DESIGN §1):
    ids + weights to the host once -> cache.lookup -> hit pairs / miss pairs
    misses: activations to the host, runner.submit(...)          (CPU starts first)
    hits:   grouped slot kernel on the card                       (runs while the CPU works)
    combine: hits + runner.sync(...) (result back to the card)
    promotions the policy admits (within the step's PCIe budget): weights into their slots on a
    side stream; the layer's next grouped launch waits for them.
Step boundaries come from HybridModel.forward (begin_step / end_step), which also writes the trace.

Each card keeps a device expert->slot table per layer (CardRuntime.tables, -1 = not in a slot),
rewritten in place on the promotion stream behind the weight copies, so work that waits for the
layer's `ready` event never reads a slot whose weights are not there yet.
A layer whose every expert is resident cannot miss, so it skips the per-layer host sync: slot ids
come from its table, and its cache lookup (counters, policy) runs at the end of the step from one
copy of the step's deferred ids. Lookups of different layers touch disjoint state and a layer
without misses promotes nothing, so the bookkeeping (and an offline replay of the trace) is the
same as if the lookup had run in place. In a graphed decode step a layer that can miss runs its
hits in the graph too (through its table; hybrid.runtime.miss_link) and `linked` does the host's
part: the CPU's misses (the pairs the table marked absent) and their sum to pinned memory; the
lookup, its check against the table and the promotions follow in settle_linked, once the next
segment is launched. A promotion never
evicts an expert the step uses (ExpertCache.evictable), so the hits still running on the card
never read a slot that is being overwritten.

A step run ahead (HybridModel.enqueue; every layer resident and graphed) only launches: begin_step(ahead=True)
leaves the caches alone, stage_step copies its route buffers to pinned host memory behind the step (one
async copy per block, an event per device) and hands its record back; resume_step(record) later waits for
those events, starts the caches' step and makes it current again, and end_step settles it as usual, so
the caches see begin, the step's lookups, end in the same order as without running ahead (the next step
enqueued meanwhile touches no cache state). drop_step forgets a step that will not be used. A step's
time (stats, trace) is from its start, or from the previous step's end if that came later: steps run
ahead overlap, and their times tile the wall clock instead.

Prefill offload (prefill_min > 0): in an eager prefill step of at least prefill_min tokens a layer's
misses do not go to the CPU runner: they are streamed into the card's staging slots and run there
by the same grouped kernel (hybrid.runtime.prefill_stream), after the hits. The cache's lookup,
counters, promotions and trace are the same as without it (streamed experts are misses); their
stored bytes count as PCIe kind "prefill_stream". Decode steps and `linked` never stream.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from hybrid.experts.cache import ExpertCache
from hybrid.runtime.placement import CardSpec
from hybrid.runtime.prefill_stream import PrefillStream
from hybrid.runtime.store_stage import promote_mode
from hybrid.runtime.slots import CardSlots
from hybrid.runtime.stats import RuntimeStats
from hybrid.switches import env_flag


def cpu_direct_enabled() -> bool:
    """HYBRID_CPU_DIRECT=0: a graphed can-miss layer hands its misses to the CPU runner's pool thread
    and waits (submit + sync) instead of running them on the calling thread (runner.run)."""
    return env_flag("HYBRID_CPU_DIRECT")


ACT_WITH_IDS = 8    # up to this many tokens, a layer that may miss copies x with its routed ids


@dataclass
class CardRuntime:
    """One logical card: its placement, cache bookkeeping, slot storage and promotion stream."""

    spec: CardSpec
    cache: ExpertCache
    slots: CardSlots
    stream: object = None                         # torch.cuda.Stream for promotions (CUDA only)
    ready: dict = field(default_factory=dict)     # layer -> cuda Event after its last promotions
    tables: dict = field(default_factory=dict)    # layer -> expert->local slot table [E] int32 on the
                                                  #   device, -1 = not in a slot (updated in place)
    full: dict = field(default_factory=dict)      # layer -> its table, for layers whose every
                                                  #   expert is resident
    prefill: PrefillStream | None = None          # staging slots for prefill offload (first use)

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)

    def refresh(self, layer: int) -> None:
        """The layer's device table from the cache (local slot ids, what the slot storage indexes),
        and whether every expert of the layer is resident (then it can skip the host sync).
        After the first, the table is rewritten in place on the promotion stream, behind the weight
        copies queued there: work that waits for the layer's `ready` event sees both or neither."""
        table = self.cache.slot_table(layer)                                  # [E] int64, -1 = absent
        local = np.where(table >= 0, table - self.slots.layer_slots[layer][0], -1).astype(np.int32)
        dev = self.tables.get(layer)
        if dev is None:
            dev = self.tables[layer] = torch.from_numpy(local).to(self.device)
        elif self.device.type == "cuda":
            src = torch.from_numpy(local).pin_memory()      # kept by the host allocator until copied
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                dev.copy_(src, non_blocking=True)
        else:
            dev.copy_(torch.from_numpy(local))
        if (table >= 0).all():
            self.full[layer] = dev
        else:
            self.full.pop(layer, None)


class HybridExperts:
    """ExpertExecutor over cards + a CPU runner. get_expert(layer, e) -> (gate, up, down) QWeight."""

    def __init__(self, cards: list[CardRuntime], cpu, get_expert, num_layers: int, stats: RuntimeStats,
                 trace=None, prefill_min: int = 0, store_source=None):
        self.cards, self.cpu, self.get_expert = cards, cpu, get_expert
        self.cpu_direct = cpu_direct_enabled() and hasattr(cpu, "run")   # linked(): runner.run
        self.card_of = {l: c for c in cards for l in c.spec.layer_ids}
        self.num_layers, self.stats, self.trace = num_layers, stats, trace
        self.prefill_min = int(prefill_min)  # prefill steps of >= this many tokens stream misses (0: off)
        self.store_source = store_source     # hybrid.runtime.store_stage.StoreSource: streamed from there
        stats.pcie.setdefault("prefill_stream", 0)
        self._step: dict | None = None
        self.version = 0                     # bumped when a layer's residency may have changed
        self._tok: dict = {}                 # (T, k, device) -> token index of each pair [T*k] int32
        self._last_end = 0.0                 # perf_counter() at the last end_step
        self._unsettled: tuple | None = None  # a linked layer whose cache side is still due (settle_linked)

    # ---- step boundaries (HybridModel.forward) -----------------------------------------------
    def begin_step(self, tokens: int, phase: str = "decode", ahead: bool = False) -> None:
        """ahead: a step run ahead (module doc): the caches' step starts at resume_step."""
        if not ahead:
            for c in self.cards:
                c.cache.begin_step()
        self._step = {"t0": time.perf_counter(), "tokens": tokens, "phase": phase, "ids": [None] * self.num_layers,
                      "weights": [None] * self.num_layers, "hits": [0] * self.num_layers,
                      "promotions": [0] * self.num_layers, "gpu": [], "cpu_s": 0.0, "pcie": 0,
                      "deferred": [], "streamed": 0}

    def end_step(self) -> None:
        self.settle_linked()
        self._settle(self._step)
        st, self._step = self._step, None
        gpu_s = self._gpu_times(st["gpu"])
        phase = st["phase"]
        now = time.perf_counter()
        seconds = now - max(st["t0"], self._last_end)            # steps run ahead overlap: tile instead
        self._last_end = now
        self.stats.add_step(phase, seconds, st["tokens"])
        if self.trace is not None:
            timings = {"step_ms": round(1e3 * seconds, 4), "gpu_expert_ms": round(1e3 * gpu_s, 4),
                       "cpu_expert_ms": round(1e3 * st["cpu_s"], 4), "pcie_bytes": st["pcie"]}
            if st["streamed"]:
                timings["streamed_experts"] = st["streamed"]
            self.trace.step(np.stack(st["ids"]), weights=np.stack(st["weights"]), phase=phase,
                            hits=st["hits"], promotions=st["promotions"], timings=timings)

    def abort_step(self) -> None:
        """Drop the step in progress (its forward raised)."""
        self._step, self._unsettled = None, None

    def stage_step(self) -> dict:
        """The launched step run ahead: its route buffers to pinned host memory (async, behind it),
        an event per device after them; -> its record for resume_step. Nothing is counted yet."""
        st, self._step = self._step, None
        staged, devs = [], set()
        for item in st["deferred"]:
            if item[0] != "block":
                raise RuntimeError("a step run ahead has eager resident layers (graphed steps only)")
            _, layers, buf = item
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=buf.is_cuda)
            host.copy_(buf, non_blocking=True)                                # [n, 1, 2k]
            staged.append(("block", layers, host))
            devs.add(buf.device)
        st["deferred"], st["events"] = staged, []
        for dev in devs:
            if dev.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                st["events"].append(ev)
        return st

    def resume_step(self, st: dict) -> None:
        """A staged step (stage_step) becomes the current one, its routing on the host; end_step next."""
        if self._step is not None:
            raise RuntimeError("resume_step while another step is in progress")
        for ev in st.pop("events"):
            ev.synchronize()
        for c in self.cards:
            c.cache.begin_step()
        self._step = st

    def drop_step(self, st: dict) -> None:
        """Forget a staged step that will not be used (after its copies are done): nothing counted."""
        for ev in st.pop("events", []):
            ev.synchronize()

    def _settle(self, st: dict) -> None:
        """Cache lookups of the step's fully resident layers, from one host copy per block. Without a trace,
        a layer routing more (token, expert) pairs than it has experts (a prefill step) crosses as its set of
        routed experts, marked on its device ([n, E + 1] bytes instead of [n, T, 2k] floats)."""
        if not st["deferred"]:
            return
        t0 = time.perf_counter()
        blocks, by_dev = [], {}
        for item in st["deferred"]:
            if item[0] == "block":                                            # graphed: [n, T, 2k] buffer
                _, layers, buf = item
                k = buf.shape[2] // 2
                marks = self._marks_only(buf.shape[1] * k)
                blocks.append((layers, buf[..., :k], None) if marks else (layers, buf, k))
            else:
                by_dev.setdefault(item[1].device, []).append(item)
        for items in by_dev.values():
            layers, k = [layer for layer, _, _ in items], items[0][1].shape[1]
            if self._marks_only(items[0][1].numel()):
                blocks.append((layers, torch.stack([i for _, i, _ in items]), None))
            else:
                blocks.append((layers, torch.stack([torch.cat([i.float(), w.float()], 1) for _, i, w in items]), k))
        by_card: dict[int, tuple[list, list]] = {}   # card -> ([(layer, ids, w)], [(layer, marks)])
        e = self.cards[0].cache.num_experts
        for layers, buf, k in blocks:
            if k is None:                                                     # ids [n, T, k] -> marks
                marks = used_marks(buf, e)
                if buf.is_cuda:
                    self.add_pcie("ids_d2h", marks.nbytes)
                for layer, m in zip(layers, marks):
                    by_card.setdefault(id(self.card_of[layer]), ([], []))[1].append((layer, m))
                continue
            for layer, b in zip(layers, buf.cpu().numpy()):                   # one copy per block; b [T, 2k]
                by_card.setdefault(id(self.card_of[layer]), ([], []))[0].append(
                    (layer, b[:, :k].astype(np.int64), b[:, k:]))
        n = 0
        for rows, marked in by_card.values():
            n += len(rows) + len(marked)
            if rows:
                self._settle_card(self.card_of[rows[0][0]], rows)
            if marked:
                self._settle_marks(self.card_of[marked[0][0]], marked, e)
        dt = (time.perf_counter() - t0) / max(n, 1)
        for rows, marked in by_card.values():
            for item in rows + marked:
                self.stats.route_sync_s[item[0]] += dt

    def _marks_only(self, pairs: int) -> bool:
        """Whether a layer's routing of `pairs` (token, expert) pairs settles as marks (_settle)."""
        return self.trace is None and pairs > self.cards[0].cache.num_experts

    def _settle_card(self, card: CardRuntime, items: list) -> None:
        """One card's deferred lookups in one batched call (ExpertCache.lookup_resident: what one
        lookup per layer would count); a miss there is a bug (a fully resident layer missed)."""
        layers = [layer for layer, _, _ in items]
        self._settle_lookups(card, layers, [(ids, w) for _, ids, w in items],
                             lambda: card.cache.lookup_resident(layers, np.stack([ids for _, ids, _ in items])))

    def _settle_marks(self, card: CardRuntime, items: list, e: int) -> None:
        """_settle_card from each layer's marked experts ([E + 1] bool; the last: an id out of range)."""
        layers, marks = [layer for layer, _ in items], np.stack([m for _, m in items])
        if marks[:, e].any():
            raise ValueError(f"layers {layers}: routed ids outside 0..{e - 1}")
        self._settle_lookups(card, layers, [(None, None)] * len(layers),
                             lambda: card.cache.lookup_used(layers, marks[:, :e]))

    def _settle_lookups(self, card: CardRuntime, layers: list, routes: list, lookup) -> None:
        """lookup() -> each layer's unique hit experts; then each layer's step accounting with its
        (ids, weights) on the host, or (None, None) where only its expert set crossed."""
        try:
            used = lookup()
        except RuntimeError as exc:
            raise RuntimeError(f"a fully resident layer missed: {exc}") from None
        cuda = card.device.type == "cuda"
        for layer, (ids_h, w_h), u in zip(layers, routes, used):
            self._account(layer, cuda, ids_h, w_h, len(u), 0, 0)

    def _gpu_times(self, pending: list) -> float:
        """Resolve the step's (layer, start, end) CUDA events into seconds (events are done by now)."""
        total = 0.0
        for layer, a, b in pending:
            b.synchronize()
            s = a.elapsed_time(b) / 1e3
            self.stats.gpu_expert_s[layer] += s
            total += s
        return total

    # ---- one layer ---------------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] on the layer's device -> Σ_k weight · expert(x) [T, H].
        packed: [T, 2k + H] fp32 = ids, weights, x already side by side on the device (the graphed
        decode step makes it inside its graph), so one copy brings all three to the host."""
        card, st = self.card_of[layer], self._step
        if st is None:                       # called outside HybridModel.forward: a one-layer step
            raise RuntimeError("HybridExperts called outside a step (use HybridModel.forward)")
        if layer in card.full:
            return self._resident(card, layer, x, ids, weights)
        t0 = time.perf_counter()
        small = x.is_cuda and x.shape[0] <= ACT_WITH_IDS                      # decode: x rides along
        if packed is not None:
            ids_h, w_h, x_h = _split(packed.cpu().numpy(), ids.shape[1], True)
        else:
            ids_h, w_h, x_h = _to_host(ids, weights, x if small else None)    # [T, k] int64, f32; [T, H]
        lk = card.cache.lookup(layer, ids_h)
        hit = lk.slots >= 0                                                   # [T, k]
        mt, mj = np.nonzero(~hit)                                             # miss pairs [A_m]
        stream = len(mt) > 0 and self.streams_prefill(x.shape[0])
        if len(mt) and x_h is None and not stream:
            x_h = x.float().cpu().numpy()                                     # [T, H] f32
        self.stats.route_sync_s[layer] += time.perf_counter() - t0
        if small:
            self.add_pcie("act_d2h", x.numel() * 4)
        cpu_pairs = len(mt) if not stream else 0
        handle = self.cpu.submit(layer, ids_h[mt, mj], mt, w_h[mt, mj], x_h) if cpu_pairs else None
        t_sub = time.perf_counter()
        out = self._hits(card, layer, x, w_h, lk.slots, hit)                 # [T, H] fp32 or None
        if stream:
            y = self._stream(card, layer, x, ids_h[mt, mj], mt, w_h[mt, mj])  # [T, H] fp32
            out = y if out is None else out + y
        if handle is not None:
            t_wait = time.perf_counter()
            y = torch.from_numpy(self.cpu.sync(handle))                       # [T, H] f32
            t_done = time.perf_counter()
            self.stats.cpu_wait_s[layer] += t_done - t_wait
            self.stats.cpu_expert_s[layer] += t_done - t_sub
            st["cpu_s"] += t_done - t_sub
            y = y.to(x.device, non_blocking=False)
            out = y if out is None else out + y
        self._promote(card, layer, lk)
        self._account(layer, x.is_cuda, ids_h, w_h, len(lk.hits), cpu_pairs, x.numel(), act_counted=small)
        return out.to(x.dtype)

    def streams_prefill(self, tokens: int) -> bool:
        """Whether this step's misses are streamed to the card (an eager prefill step of at least
        prefill_min tokens) instead of run on the CPU runner."""
        st = self._step
        return bool(self.prefill_min) and st["phase"] == "prefill" and tokens >= self.prefill_min

    def _stream(self, card: CardRuntime, layer: int, x, expert_ids, token_rows, route_w) -> torch.Tensor:
        """The layer's missed pairs [A] through the card's staging slots (prefill offload) -> [T, H]
        fp32; timed like the hits (CUDA events on the GPU, so the wait for uploads is in it)."""
        if card.prefill is None:
            card.prefill = PrefillStream(card.device, card.stream, source=self.store_source)
        ps, n0, b0 = card.prefill, card.prefill.experts, card.prefill.bytes
        if x.is_cuda:
            cur = torch.cuda.current_stream(x.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cur)
            out = ps.run(layer, x, expert_ids, token_rows, route_w, self.get_expert)
            b.record(cur)
            self._step["gpu"].append((layer, a, b))
            self.add_pcie("prefill_stream", ps.bytes - b0)
        else:
            t0 = time.perf_counter()
            out = ps.run(layer, x, expert_ids, token_rows, route_w, self.get_expert)
            self.stats.gpu_expert_s[layer] += time.perf_counter() - t0
        self._step["streamed"] += ps.experts - n0
        return out

    def prefill_stream_stats(self) -> dict:
        """What prefill offload streamed, summed over the cards: experts, bytes, groups, layers."""
        tot = {"experts": 0, "bytes": 0, "groups": 0, "layers": 0, "staging_bytes": 0}
        for c in self.cards:
            if c.prefill is not None:
                for k, v in c.prefill.stats().items():
                    tot[k] += v
                tot["staging_bytes"] += c.prefill.nbytes
        return tot

    def linked(self, layer: int, link) -> None:
        """The host's part of a can-miss layer whose hits ran inside its decode graph
        (hybrid.runtime.graphs, MissLink): wait for the routed row, run the misses (the pairs the
        graph's slot table marked absent) on the CPU while the card runs the hits, write their sum to
        pinned memory for the next graph. The cache's side (lookup, promotions, accounting) waits for
        settle_linked(), which the graphs call once the next segment is launched: it then runs in
        the card's shadow instead of between the CPU's sum and the next launch, in the same order of
        cache operations (before the next layer's lookup). The lookup must find the hits the
        graph's slot table found: a difference is a bug (an expert summed twice or never), so it raises."""
        if self._step is None:
            raise RuntimeError("HybridExperts called outside a step (use HybridModel.forward)")
        self.settle_linked()
        t0 = time.perf_counter()
        ids_h, w_h, local, x_h = link.fetch()                                 # [1, k] x3, [1, H]
        mt, mj = np.nonzero(local < 0)                                        # miss pairs [A_m]
        self.stats.route_sync_s[layer] += time.perf_counter() - t0
        y = None
        if len(mt):
            t_sub = time.perf_counter()
            if self.cpu_direct:                   # nothing to do meanwhile: no hand-off to a worker
                y = self.cpu.run(layer, ids_h[mt, mj], mt, w_h[mt, mj], x_h)  # [1, H] f32
            else:
                y = self.cpu.sync(self.cpu.submit(layer, ids_h[mt, mj], mt, w_h[mt, mj], x_h))
            t_done = time.perf_counter()
            self.stats.cpu_wait_s[layer] += t_done - t_sub
            self.stats.cpu_expert_s[layer] += t_done - t_sub
            self._step["cpu_s"] += t_done - t_sub
        link.put(y)
        self._unsettled = (layer, ids_h, w_h, local, len(mt), x_h.size, link.cuda)

    def settle_linked(self) -> None:
        """The cache's side of the last linked layer (see linked): its lookup, checked against the
        graph's slot table, promotions and accounting; nothing pending: returns."""
        u, self._unsettled = self._unsettled, None
        if u is None:
            return
        layer, ids_h, w_h, local, misses, x_elems, cuda = u
        card = self.card_of[layer]
        t0 = time.perf_counter()
        lk = card.cache.lookup(layer, ids_h)
        want = np.where(lk.slots >= 0, lk.slots - card.slots.layer_slots[layer][0], -1)
        if not np.array_equal(want, local):
            raise RuntimeError(f"layer {layer}: the device slot table {local.tolist()} disagrees with "
                               f"the expert cache {want.tolist()} for experts {ids_h.tolist()}")
        self.stats.route_sync_s[layer] += time.perf_counter() - t0
        if cuda:
            self.add_pcie("act_d2h", x_elems * 4)
        self._promote(card, layer, lk)
        self._account(layer, cuda, ids_h, w_h, len(lk.hits), misses, x_elems, act_counted=True)

    def has_slots(self, layer: int) -> bool:
        """Whether the layer has slot storage on its card (a layer given 0 slots has none)."""
        return self.card_of[layer].slots.layer_slots[layer][1] > 0

    def graph_hits(self, layer: int) -> bool:
        """Whether a CUDA graph can run the layer's hits over all routed pairs (slot -1 = absent)."""
        return self.card_of[layer].slots.graph_safe(layer)

    def _resident(self, card: CardRuntime, layer: int, x, ids, weights) -> torch.Tensor:
        """Every expert of the layer is in a slot: no host sync, lookup deferred to the step's end."""
        if x.is_cuda:
            self._wait_ready(card, layer)
            cur = torch.cuda.current_stream(x.device)   # the layer's card, not the current device
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cur)
            out = self.moe_device(layer, x, ids, weights)
            b.record(cur)
            self._step["gpu"].append((layer, a, b))
        else:
            t0 = time.perf_counter()
            out = self.moe_device(layer, x, ids, weights)
            self.stats.gpu_expert_s[layer] += time.perf_counter() - t0
        self._step["deferred"].append((layer, ids, weights))
        return out

    # ---- graph-safe pieces (hybrid.runtime.graphs) ---------------------------------------------
    def device_only(self, layer: int) -> bool:
        """True when the layer's MoE needs no host work: every expert resident on its card."""
        return layer in self.card_of[layer].full

    def moe_device(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A fully resident layer's experts, device work only (capturable): -> [T, H] x.dtype.
        No stats, no bookkeeping: the caller reports the routing (note_device / deferred)."""
        slot_ids = self.card_of[layer].full[layer][ids.reshape(-1)]           # [T*k] int32 local
        return self.moe_slots(layer, x, slot_ids, weights).to(x.dtype)

    def route_out(self, layer: int, t: int, row: torch.Tensor, plan: bool = True):
        """Buffers decode_dense's router launch also fills: the layer's expert -> slot table (-1 where
        not resident: a can-miss layer's graph), a slot-id buffer [T*k] int32 (kept per layer:
        graph-static), the route-buffer row [T, 2k] (ids as floats, weights) and, for packed slot
        storage on a GPU, the grouped kernels' routing of those slot ids (RoutePlan, graph-static;
        plan=False: none, the MoE launch routes itself)."""
        from hybrid.kernels.moe_route import RoutePlan
        from hybrid.model.qwen_moe import RouteOut

        card, k = self.card_of[layer], row.shape[-1] // 2
        key = ("slots", layer, t, k, row.device)
        slots = self._tok.get(key)
        if slots is None:
            slots = self._tok[key] = torch.zeros(t * k, dtype=torch.int32, device=row.device)
        packed, route_plan = card.slots.packed(layer), None
        if plan and packed is not None and row.is_cuda and RoutePlan.fits(t, k):
            pkey = ("plan", layer, t, k, row.device)
            route_plan = self._tok.get(pkey)
            if route_plan is None:
                route_plan = self._tok[pkey] = RoutePlan.new(t, k, packed.num_slots, packed.hidden, row.device)
        return RouteOut(card.tables[layer], slots, row, route_plan)

    def moe_slots(self, layer: int, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                  plan=None) -> torch.Tensor:
        """moe_device with the slot ids already made (route_out): -> [T, H] fp32, no gather, no cast.
        plan: route_out's RoutePlan (used where the router's launch made it)."""
        card = self.card_of[layer]
        t, k = weights.shape
        key = (t, k, x.device)
        tok = self._tok.get(key)
        if tok is None:
            tok = torch.arange(t, dtype=torch.int32, device=x.device).repeat_interleave(k)  # [T*k]
            self._tok[key] = tok
        return card.slots.moe_local(layer, x, slot_ids, tok, weights.reshape(-1).float(), plan=plan)

    def prepare_device(self, layers) -> None:
        """Before replaying graphed layers: the stream waits for their pending promotions."""
        for layer in layers:
            self._wait_ready(self.card_of[layer], layer)

    def note_device(self, layers: list[int], route_buf: torch.Tensor) -> None:
        """After a graph replay: the routing of its resident layers, route_buf [n, T, 2k] (ids as
        floats, then weights), is settled at the step's end like the eager path's deferred ids."""
        self._step["deferred"].append(("block", list(layers), route_buf))

    def _wait_ready(self, card: CardRuntime, layer: int) -> None:
        if layer in card.ready:
            torch.cuda.current_stream(card.device).wait_event(card.ready.pop(layer))

    def _hits(self, card: CardRuntime, layer: int, x, w_h: np.ndarray, slots_h: np.ndarray, hit: np.ndarray):
        """The hits' (slot, token, weight) made on the host, where the lookup left them: one int32
        [3, A] copy up (weights bit for bit in row 2), no gather or casts on the device. Rows are
        padded to a multiple of 4 entries: each row starts 16-byte aligned, as the kernels require."""
        ht, hj = np.nonzero(hit)                                              # hit pairs [A_h]
        n = len(ht)
        if not n:
            return None
        sel = np.zeros((3, -(-n // 4) * 4), dtype=np.int32)
        sel[0, :n] = slots_h[ht, hj] - card.slots.layer_slots[layer][0]       # local to the layer
        sel[1, :n] = ht
        sel[2, :n] = w_h[ht, hj].astype(np.float32).view(np.int32)
        sel = torch.from_numpy(sel).to(x.device)[:, :n]                       # [3, A_h], one copy
        return self._launch(card, layer, x, sel[0], sel[1], sel[2].view(torch.float32))

    def _launch(self, card: CardRuntime, layer: int, x, slot_ids, tok, route_w) -> torch.Tensor:
        """The grouped slot kernel for one layer's hits (slot ids local to the layer), timed (CUDA
        events on the GPU) -> [T, H] fp32."""
        dev = x.device
        if dev.type == "cuda":
            self._wait_ready(card, layer)
            cur = torch.cuda.current_stream(dev)   # the layer's card, not the current device
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cur)
            out = card.slots.moe_local(layer, x, slot_ids, tok, route_w).float()
            b.record(cur)
            self._step["gpu"].append((layer, a, b))
            return out
        t0 = time.perf_counter()
        out = card.slots.moe_local(layer, x, slot_ids, tok, route_w).float()
        self.stats.gpu_expert_s[layer] += time.perf_counter() - t0
        return out

    def _promote(self, card: CardRuntime, layer: int, lk) -> None:
        done = card.cache.promote_misses(layer, lk)
        packed = self._promote_target(card, layer) if done else None
        for p in done:
            if packed is not None:                # from the pinned CPU store: no checkpoint read, no host sync
                self.store_source.load_slot(packed, card.slots.local(layer, p.slot), layer, p.expert, card.stream)
            else:
                card.slots.load(layer, p.slot, self.get_expert(layer, p.expert), stream=card.stream)
        if done:
            card.refresh(layer)
            self.version += 1
        if done and card.stream is not None:
            ev = torch.cuda.Event()
            ev.record(card.stream)
            card.ready[layer] = ev
        self._step["promotions"][layer] = len(done)
        if done and card.device.type == "cuda":
            self.add_pcie("promotions", len(done) * card.cache.bytes_per_expert)

    def _promote_target(self, card: CardRuntime, layer: int):
        """The layer's packed slot storage when its promotions read the pinned CPU store
        (HYBRID_PROMOTE_SOURCE=store, a store of the layer's weight type), else None (checkpoint)."""
        src = self.store_source
        return src.target(card.slots, layer) if src is not None and promote_mode() == "store" else None

    def _account(self, layer: int, cuda: bool, ids_h, w_h, hits: int, misses: int, x_elems: int,
                 act_counted: bool = False) -> None:
        """Record the layer's routing (hits: its unique resident experts) for the trace; count what
        crossed PCIe (f32 activations; act_counted: x already went down with the ids)."""
        st = self._step
        st["ids"][layer], st["weights"][layer], st["hits"][layer] = ids_h, w_h, hits
        if cuda and ids_h is not None:                       # (marks: counted per block by _settle)
            self.add_pcie("ids_d2h", ids_h.size * 8)
            if misses:
                if not act_counted:
                    self.add_pcie("act_d2h", x_elems * 4)
                self.add_pcie("out_h2d", x_elems * 4)

    def add_pcie(self, kind: str, n: int) -> None:
        self.stats.pcie[kind] = self.stats.pcie.get(kind, 0) + int(n)
        self._step["pcie"] += int(n)


def _to_host(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor | None = None):
    """One device->host copy for all: ids [T, k] int64, weights [T, k] (and x [T, H] when given)
    -> numpy (x_h None when x is None)."""
    if not ids.is_cuda:
        x_h = None if x is None else x.float().numpy()
        return ids.numpy().astype(np.int64, copy=False), weights.float().numpy(), x_h
    return _split(pack_route(ids, weights, x).cpu().numpy(), ids.shape[1], x is not None)


def used_marks(ids: torch.Tensor, e: int) -> np.ndarray:
    """ids [n, T, k] (any dtype holding the expert ids exactly) -> [n, e + 1] bool on the host: row j marks the
    experts layer j routes to; column e, any id outside 0..e-1. Reduced on the ids' device, one small copy."""
    idx = ids.reshape(ids.shape[0], -1).long()
    idx = torch.where((idx >= 0) & (idx < e), idx, e)
    marks = torch.zeros(ids.shape[0], e + 1, dtype=torch.bool, device=ids.device)
    return marks.scatter_(1, idx, True).cpu().numpy()


def pack_route(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T, k], weights [T, k] (and x [T, H]) side by side as fp32 [T, 2k (+H)] (ids < 2^24: exact)."""
    return torch.cat([ids.float(), weights.float()] + ([] if x is None else [x.float()]), dim=1)


def _split(both: np.ndarray, k: int, with_x: bool):
    """pack_route's row on the host -> ids int64 [T, k], weights f32 [T, k], x f32 [T, H] or None."""
    return both[:, :k].astype(np.int64), both[:, k:2 * k], both[:, 2 * k:] if with_x else None

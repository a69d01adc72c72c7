"""Prefill offload: a layer's missed experts streamed into a card's staging slots and run there.

Legend: T tokens, H hidden, I expert intermediate, A (token, expert) pairs that missed, U distinct
missed experts, G experts per staging group (PREFILL_STAGE_GROUP).

A prefill step of many tokens touches almost every expert of a layer with T*k/E rows each; the CPU
runner's GEMMs over them cost more than copying the experts to the card (a layer of Qwen3-30B-A3B
NVFP4 is ~340 MB: ~28 ms over PCIe 3) and running them in the grouped kernel, as llama.cpp does for
large batches. Per layer (HybridExperts.__call__, eager prefill steps only):

    for each group of G missed experts (ascending ids), staging buffer b = group % 2:
        from the CPU expert store (default where the CPU runner has one pinned for the cards,
        hybrid.runtime.store_stage):
        copy stream: wait until the previous group's store slots were unpacked, DMA this group's
               slots as stored from the pinned store to the card (no host copy)
        side stream (the card's promotion stream): wait until the kernel that last read b's slots
               is done (`free`) and the DMA, unpack into the checkpoint's byte layout, pack into
               b's QPN slots (hybrid.runtime.stage_pack), record `ready` (the next group's DMA
               runs during this pack)
        else (from the checkpoint, HYBRID_PREFILL_SOURCE=checkpoint or no pinned store):
        host:  wait until b's pinned buffer was copied out (its `uploaded` event), then copy the
               group's stored bytes (get_expert: mmap-backed, pageable, so they cannot be DMA'd
               directly) into it, FILL_THREADS numpy memcpys at a time
        side stream: wait `free`, copy pinned -> device (one copy per array), record `uploaded`,
               pack into b's QPN slots, record `ready`
        compute stream: wait `ready`, grouped kernel over the group's pairs, record `free`
so the next group's copy and pack run while this group's kernel does. The staging area (2 x G
slots, one device buffer of G stored experts (+ one of G store slots), pinned host 2 x G) is made
on first use and kept; the planner reserves its bytes (hybrid.planner.memory.prefill_stage_bytes).

CPU mode (a card that is the CPU) runs the same groups through the same slot storage types as the
cache (the QPN reference / torch reference), loading each expert with the storage's load(); only
the copies, the pack and the events are CUDA's. Streamed experts stay misses for the expert cache.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import layout
from hybrid.planner.memory import PREFILL_STAGE_GROUP
from hybrid.runtime.slots import HoldBudget, QPNSlots, make_store
from hybrid.runtime.stage_pack import pack_group
from hybrid.runtime.store_stage import source_mode

FILL_THREADS = min(4, os.cpu_count() or 1)   # threads copying a group's stored bytes into pinned memory
_POOL: list = []


@dataclass
class _Buffer:
    store: object                                  # QPNSlots / TorchExpertSlots of G slots
    pinned: dict = field(default_factory=dict)     # name -> pinned host tensor [G, ...] (CUDA QPN)
    uploaded: object = None                        # cuda Event: its pinned bytes were copied out
    ready: object = None                           # cuda Event: its slots hold the group
    free: object = None                            # cuda Event: the last kernel reading it is done


@dataclass
class _Area:
    """The staging area of one expert weight type: two buffers, the device copy of one group."""

    bufs: list
    raw: dict = field(default_factory=dict)        # name -> device tensor [G, ...] (CUDA QPN)
    slots_raw: object = None                       # device u8 [G, S]: store slots as uploaded
    uploaded: object = None                        # cuda Event: slots_raw holds the next group
    unpacked: object = None                        # cuda Event: slots_raw was read (may be refilled)

    @property
    def packed(self) -> bool:
        return bool(self.raw)


class PrefillStream:
    """One card's staging slots for prefill offload; counters of what it streamed."""

    def __init__(self, device: torch.device, stream=None, group: int = PREFILL_STAGE_GROUP, source=None):
        """source: a StoreSource (hybrid.runtime.store_stage) to stream from instead of the checkpoint."""
        if group < 1:
            raise ValueError(f"staging group must be >= 1 expert, got {group}")
        self.device, self.group = torch.device(device), int(group)
        self.cuda = self.device.type == "cuda"
        self.stream = stream if stream is not None or not self.cuda else torch.cuda.Stream(self.device)
        self.source = source
        self.copy_stream = None     # the store's DMA (made on first use)
        self._areas: dict = {}
        self._weights: dict = {}    # (layer, e) -> get_expert's (gate, up, down), read once
        self.experts = 0            # experts streamed (summed over layers and steps)
        self.bytes = 0              # their stored bytes (what crosses PCIe on a card)
        self.groups = 0
        self.layers = 0

    # ---- one layer ---------------------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, expert_ids: np.ndarray, token_rows: np.ndarray,
            route_w: np.ndarray, get_expert) -> torch.Tensor:
        """x [T, H]; the missed pairs' expert_ids/token_rows/route_w [A] -> Σ route_w · expert(x)
        [T, H] fp32 over them, experts streamed G at a time; get_expert(layer, e) -> (gate, up, down)."""
        experts = np.unique(expert_ids)                                       # [U] ascending
        pos = np.searchsorted(experts, expert_ids)                            # [A] index into experts
        order = np.argsort(pos, kind="stable")
        pos, tok, w = pos[order], np.asarray(token_rows)[order], np.asarray(route_w, np.float32)[order]
        g = self.group
        bounds = np.searchsorted(pos, np.arange(0, len(experts) + g, g))      # pair range per group
        sel = _selection(pos % g, tok, w, bounds, x.device)                   # one copy up
        area = self._area(*self._weight_type(layer, int(experts[0]), get_expert))
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)   # [T, H]
        for gi in range(-(-len(experts) // g)):
            buf = area.bufs[gi % 2]
            group = experts[gi * g:(gi + 1) * g].tolist()
            self._stage(area, buf, layer, group, get_expert)
            a, b = bounds[gi], bounds[gi + 1]
            if self.cuda:
                self._compute().wait_event(buf.ready)
            s_ids, s_tok, s_w = sel(gi, a, b)
            out += buf.store.moe(x, s_ids, s_tok, s_w)
            if self.cuda:
                buf.free.record(self._compute())
            self.groups += 1
        self.experts += len(experts)
        self.layers += 1
        return out

    def _compute(self):
        """The stream the layer's kernels run on: this card's current stream (not the current
        device's: with two GPUs the other card's may be current)."""
        return torch.cuda.current_stream(self.device)

    def stats(self) -> dict:
        return {"experts": self.experts, "bytes": self.bytes, "groups": self.groups, "layers": self.layers}

    # ---- staging -----------------------------------------------------------------------------
    def _stage(self, area: _Area, buf: _Buffer, layer: int, group: list[int], get_expert) -> None:
        """The group's experts into buf's slots 0..len(group)-1 (see the module doc)."""
        if area.packed and self._from_store():
            self._stage_store(area, buf, layer, group)
            return
        ws = [self._expert(layer, e, get_expert) for e in group]
        self.bytes += sum(q.nbytes for w in ws for q in w)
        if not area.packed:
            self._load(buf, ws)
            return
        if buf.uploaded is not None:
            buf.uploaded.synchronize()                  # its pinned bytes may be overwritten now
        copies = [c for j, w in enumerate(ws) for c in _copies(buf.pinned, j, w, buf.store.slots)]
        list(_pool().map(_copy, copies))                # numpy releases the GIL: memcpy in parallel
        n = len(ws)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(buf.free)
            for name, dst in area.raw.items():
                dst[:n].copy_(buf.pinned[name][:n], non_blocking=True)
            buf.uploaded.record(self.stream)
            pack_group(buf.store.slots, n, area.raw)
            buf.ready.record(self.stream)

    def _from_store(self) -> bool:
        """Whether streamed experts come from the pinned store (HYBRID_PREFILL_SOURCE, read per layer)."""
        return self.source is not None and source_mode() == "store"

    def _stage_store(self, area: _Area, buf: _Buffer, layer: int, group: list[int]) -> None:
        """The group's slots from the pinned CPU store. Copy stream: wait until the previous group's
        slots were unpacked (`unpacked`), DMA this group's into area.slots_raw, record `uploaded`; side
        stream: wait `free` and `uploaded`, unpack into area.raw, record `unpacked`, pack, record `ready`.
        So a group's DMA runs while the previous one is packed; area.raw is reused in side-stream order."""
        src, n = self.source, len(group)
        if area.slots_raw is None:
            area.slots_raw = torch.empty(self.group, src.S, dtype=torch.uint8, device=self.device)
            area.uploaded, area.unpacked = torch.cuda.Event(), torch.cuda.Event()
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copy_stream.wait_stream(self._compute())          # slots_raw exists
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(area.unpacked)
            self.bytes += src.upload(layer, group, area.slots_raw) + 12 * n      # + the fp32 global scales
            area.uploaded.record(self.copy_stream)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(buf.free)
            self.stream.wait_event(area.uploaded)
            src.pack_into(buf.store.slots, 0, area.slots_raw, area.raw, layer, group, read_done=area.unpacked)
            buf.ready.record(self.stream)

    def _expert(self, layer: int, e: int, get_expert) -> tuple:
        """get_expert's weights, kept: the checkpoint's tensors are views of its mmap (no copy held),
        and reading them costs ~1 ms an expert (safetensors look-ups, scale checks): 128 of them per
        layer would cost more than their upload."""
        w = self._weights.get((layer, e))
        if w is None:
            w = self._weights[(layer, e)] = get_expert(layer, e)
        return w

    def _load(self, buf: _Buffer, ws: list) -> None:
        """Storage without the packed path (CPU mode, dense experts): the storage's own load()."""
        if not self.cuda:
            for j, w in enumerate(ws):
                buf.store.load(j, *w)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(buf.free)
            for j, w in enumerate(ws):
                buf.store.load(j, *w, stream=self.stream)
            buf.ready.record(self.stream)

    def _weight_type(self, layer: int, e: int, get_expert) -> tuple:
        """(qtype, hidden, inter) of the layer's experts: the pinned store's when streaming from it
        (no checkpoint read at all), else expert e's as get_expert gives it."""
        if self.cuda and self._from_store():
            st = self.source.store
            return st.qtype, st.hidden, st.inter
        gate = self._expert(layer, e, get_expert)[0]
        return gate.qtype, gate.shape[1], gate.shape[0]

    def _area(self, qtype, hidden: int, inter: int) -> _Area:
        """The staging area for one expert weight type, made on first use and kept."""
        key = (qtype, hidden, inter)
        area = self._areas.get(key)
        if area is not None:
            return area
        hold = HoldBudget()
        bufs = [_Buffer(make_store(self.group, hidden, inter, qtype, self.device, True, hold))
                for _ in range(2)]
        area = _Area(bufs)
        if self.cuda:
            for b in bufs:
                b.uploaded, b.ready, b.free = torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event()
                b.free.record(self._compute())           # nothing reads it yet
            if isinstance(bufs[0].store, QPNSlots) and bufs[0].store.host is None:
                shapes = _raw_shapes(qtype, self.group, hidden, inter)
                area.raw = {k: torch.empty(s, dtype=dt, device=self.device) for k, (s, dt) in shapes.items()}
                for b in bufs:
                    b.pinned = {k: torch.empty(s, dtype=dt, pin_memory=True) for k, (s, dt) in shapes.items()}
            self.stream.wait_stream(self._compute())     # the new tensors exist
        self._areas[key] = area
        return area

    @property
    def nbytes(self) -> int:
        """Device bytes the staging areas hold (slots + the device copy of one group)."""
        total = 0
        for area in self._areas.values():
            total += sum(t.numel() * t.element_size() for t in area.raw.values())
            for b in area.bufs:
                inner = getattr(b.store, "slots", None)
                for name in ("w13", "w2", "s13", "s2", "gs"):
                    t = getattr(inner, name, None)
                    total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total


def _raw_shapes(qtype: QType, g: int, h: int, i: int) -> dict:
    """name -> (shape, dtype) of one group's stored bytes, gate rows then up rows (stage_pack)."""
    u8 = torch.uint8
    if qtype is QType.NVFP4:
        return {"d13": ((g, 2 * i, h // 2), u8), "s13": ((g, 2 * i, h // 16), u8),
                "d2": ((g, h, i // 2), u8), "s2": ((g, h, i // 16), u8), "gs": ((g, 3), torch.float32)}
    return {"d13": ((g, 2 * i, h), u8), "d2": ((g, h, i), u8), "gs": ((g, 3), torch.float32)}


def _fill(pinned: dict, j: int, w: tuple, slots) -> None:
    """Expert (gate, up, down) as stored into row j of the (pinned) host buffer."""
    for c in _copies(pinned, j, w, slots):
        _copy(c)


def _copies(pinned: dict, j: int, w: tuple, slots) -> list:
    """The (dst, src) numpy pairs that put expert (gate, up, down) as stored into row j of the pinned
    buffer (checked like a load); its folded global scales are written here."""
    gate, up, down = w
    _check(w, slots.qtype, slots.hidden, slots.inter)
    i = gate.shape[0]
    u8 = lambda t: t.view(torch.uint8).numpy()                                # noqa: E731
    out = [(pinned["d13"][j, :i], gate.data), (pinned["d13"][j, i:], up.data), (pinned["d2"][j], down.data)]
    if gate.qtype is QType.NVFP4:
        out += [(pinned["s13"][j, :i], gate.scale), (pinned["s13"][j, i:], up.scale), (pinned["s2"][j], down.scale)]
    pinned["gs"].numpy()[j] = [layout.global_scale(q) for q in w]
    return [(u8(d), u8(s)) for d, s in out]


def _copy(c: tuple) -> None:
    np.copyto(c[0], c[1])


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="hybrid-stage"))
    return _POOL[0]


def _check(w: tuple, qtype: QType, h: int, i: int) -> None:
    """Every expert of a staging group has the area's weight type and shapes."""
    for name, q, shape in (("gate", w[0], (i, h)), ("up", w[1], (i, h)), ("down", w[2], (h, i))):
        if q.qtype is not qtype or tuple(q.shape) != shape:
            raise ValueError(f"{q.name or name}: expected {qtype.value} {shape} like the layer's other "
                             f"experts, got {q.qtype.value} {tuple(q.shape)}")


def _selection(local: np.ndarray, tok: np.ndarray, w: np.ndarray, bounds: np.ndarray, device):
    """The groups' (local slot, token, weight) rows in one int32 array, each group's run starting
    16-byte aligned (the kernels' rule), copied to the device once -> sel(gi, a, b) -> 3 tensors [b-a]."""
    starts = np.zeros(len(bounds), dtype=np.int64)
    for gi in range(len(bounds) - 1):
        n = bounds[gi + 1] - bounds[gi]
        starts[gi + 1] = starts[gi] + -(-n // 4) * 4
    arr = np.zeros((3, max(int(starts[-1]), 4)), dtype=np.int32)
    for gi in range(len(bounds) - 1):
        a, b, s = bounds[gi], bounds[gi + 1], starts[gi]
        arr[0, s:s + b - a] = local[a:b]
        arr[1, s:s + b - a] = tok[a:b]
        arr[2, s:s + b - a] = w[a:b].view(np.int32)
    dev = torch.from_numpy(arr).to(device)                                    # [3, sum padded]

    def sel(gi: int, a: int, b: int):
        s = int(starts[gi])
        return dev[0, s:s + b - a], dev[1, s:s + b - a], dev[2, s:s + b - a].view(torch.float32)

    return sel

"""A card's expert-cache slot storage: where the weights of resident experts live and how hits run.

Legend: T tokens, H hidden, I expert intermediate, A (token, expert) pairs that hit, S slots.
The ExpertCache hands out card-global slot ids (each layer owns a contiguous block). Storage is
grouped by weight type: quantized experts (NVFP4/FP8) go to hybrid.kernels.QPNExpertSlots and run
through the grouped qpn_moe kernel (its torch reference on CPU tensors); dense experts (BF16/FP16
checkpoints, or shapes the kernels cannot take) go to TorchExpertSlots, which runs them through
the reference linear path. Each layer has its own storage, indexed from 0.

CPU mode (a card that is the CPU): a real card keeps its slots packed and decodes them in registers;
the stand-in keeps each resident slot's weights dequantized (fp32) once, at load, so a hit costs a
matmul instead of a transient dequantize per call. Only slots are held this way, at most
`hold_bytes` of fp32 per card (HOLD_BYTES; slots past it keep their stored weights and decode them
per call as before), never the whole model; the numbers are the same as the reference kernels'
(same dequantized values, same operations, same order).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.model.linear import Linear
from hybrid.model.moe import SwiGLU, expert_sum

ExpertWeights = Callable[[int, int], tuple[QWeight, QWeight, QWeight]]
HOLD_BYTES = 2 << 30      # fp32 bytes of slot weights one CPU card may hold dequantized (2 GiB)


class HoldBudget:
    """fp32 bytes a CPU card may still hold, shared by its layers' slot storages."""

    def __init__(self, nbytes: int = HOLD_BYTES):
        self.left = int(nbytes)

    def take(self, n: int) -> bool:
        if n > self.left:
            return False
        self.left -= n
        return True

    def give(self, n: int) -> None:
        self.left += n


class TorchExpertSlots:
    """Reference slot storage (any device, any weight type): one stored SwiGLU per slot.
    On a CPU card each slot's weights are held as fp32 (see the module doc)."""

    def __init__(self, num_slots: int, device: torch.device, hold: HoldBudget | None = None):
        self.device = torch.device(device)
        self.slots: list[tuple[Linear, Linear, Linear] | None] = [None] * num_slots
        self.hold = hold if hold is not None else HoldBudget()
        self.held = [0] * num_slots

    def load(self, slot: int, gate: QWeight, up: QWeight, down: QWeight, stream=None) -> None:
        if self.device.type == "cpu":
            ws = (gate, up, down)
            if _hold(self.hold, self.held, slot, ws):
                ws = tuple(_as_f32(w) for w in ws)
            self.slots[slot] = tuple(Linear(w) for w in ws)
            return
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            self.slots[slot] = tuple(Linear(w).to(self.device) for w in (gate, up, down))

    def moe(self, x: torch.Tensor, slot_ids, token_idx, route_w) -> torch.Tensor:
        """x [T, H]; slot_ids/token_idx/route_w [A] -> Σ route_w · expert(x) [T, H] fp32 (slot -1:
        not resident, skipped)."""
        slot_ids, token_idx, route_w = drop_absent(slot_ids, token_idx, route_w)
        return expert_sum(x, slot_ids, token_idx, route_w, lambda s: SwiGLU(*self.slots[s]))


class QPNSlots:
    """Quantized slot storage through hybrid.kernels (QPN kernel on CUDA); on a CPU card the same
    math as the kernels' torch reference (hybrid.kernels.reference.ref_moe) over slots held
    dequantized (see the module doc)."""

    def __init__(self, num_slots: int, hidden: int, inter: int, qtype, device: torch.device,
                 hold: HoldBudget | None = None):
        from hybrid.kernels import QPNExpertSlots

        self.slots = QPNExpertSlots(num_slots, hidden, inter, qtype, torch.device(device))
        self.host = None if self.slots.device.type == "cuda" else [None] * num_slots
        self.hold = hold if hold is not None else HoldBudget()
        self.held = [0] * num_slots

    def load(self, slot: int, gate: QWeight, up: QWeight, down: QWeight, stream=None) -> None:
        self.slots.load(slot, gate, up, down, stream=stream)          # checks types and shapes
        if self.host is not None:
            ws = (gate, up, down)
            held = _hold(self.hold, self.held, slot, ws)
            self.host[slot] = tuple(w.dequantize(torch.float32) for w in ws) if held else ws

    def moe(self, x: torch.Tensor, slot_ids, token_idx, route_w, plan=None) -> torch.Tensor:
        """plan: a RoutePlan of slot_ids (hybrid.kernels.moe_route), packed storage on the card only."""
        if self.host is not None:
            return host_moe(x.to(torch.float16), self.host, slot_ids, token_idx, route_w.float())
        from hybrid.kernels import qpn_moe

        return qpn_moe(x.to(torch.float16), self.slots, slot_ids.int(), token_idx.int(),
                       route_w.float(), plan=plan)


def host_moe(x: torch.Tensor, host: list, slot_ids: torch.Tensor, token_idx: torch.Tensor,
             route_w: torch.Tensor) -> torch.Tensor:
    """ref_moe over held slots: x [T, H] fp16; host[s] = (gate [I, H], up [I, H], down [H, I])
    fp32 (or their QWeights, decoded here); slot_ids/token_idx/route_w [A] -> y [T, H] fp32. Slots in ascending order,
    h rounded to fp16 as the kernel does: the values ref_moe gives, without its per-call dequantize.
    Slot -1 (not resident) is skipped, as the CUDA kernel's route step skips it."""
    slot_ids, token_idx, route_w = drop_absent(slot_ids, token_idx, route_w)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)             # [T, H]
    sid = slot_ids.numpy() if slot_ids.dtype == torch.int64 else slot_ids.long().numpy()   # [A]
    xf = x.float()                                                           # [T, H]
    if x.shape[0] == 1 and len(np.unique(sid)) == len(sid):                  # decode: one row per slot
        rw = route_w.unsqueeze(1)                                            # [A, 1]
        for a in np.argsort(sid).tolist():
            y.add_(_swiglu(xf, _slot(host, int(sid[a]))) * rw[a])
        return y
    tok = token_idx.long()
    for s in np.unique(sid).tolist():
        sel = torch.from_numpy(np.flatnonzero(sid == s))                     # [a_s]
        rows = tok[sel]
        out = _swiglu(xf[rows], _slot(host, s))                              # [a_s, H]
        y.index_add_(0, rows, out * route_w[sel].unsqueeze(1))
    return y


def drop_absent(slot_ids: torch.Tensor, token_idx: torch.Tensor, route_w: torch.Tensor):
    """The pairs whose slot is >= 0 (a can-miss layer's graph passes every routed pair, -1 where the
    expert is not resident); eager only (the kept count is data-dependent)."""
    keep = slot_ids >= 0
    if bool(keep.all()):
        return slot_ids, token_idx, route_w
    return slot_ids[keep], token_idx[keep], route_w[keep]


def _slot(host: list, s: int) -> tuple:
    w = host[s] if 0 <= s < len(host) else None
    if w is None:
        raise ValueError(f"slot_ids: slot {s} is empty or out of range")
    return w


def _swiglu(xs: torch.Tensor, w: tuple) -> torch.Tensor:
    """ref_expert over held weights: xs [R, H] fp32 (fp16 values) -> [R, H] fp32, h rounded to fp16."""
    if not isinstance(w[0], torch.Tensor):                                  # a slot past the budget
        w = [t.dequantize(torch.float32) for t in w]
    hmid = F.silu(xs @ w[0].t()) * (xs @ w[1].t())                            # [R, I]
    return hmid.half().float() @ w[2].t()


def _hold(budget: HoldBudget, held: list, slot: int, ws) -> bool:
    """Replace the slot's held bytes by this expert's fp32 bytes if the budget allows -> held."""
    budget.give(held[slot])
    n = sum(4 * w.shape[0] * w.shape[1] for w in ws)
    held[slot] = n if budget.take(n) else 0
    return held[slot] > 0


def _as_f32(w: QWeight) -> QWeight:
    """A CPU slot's weight as dense fp32 (what the reference linear multiplies by)."""
    if w.qtype is QType.F32:
        return w.to("cpu")
    return QWeight(QType.F32, w.shape, w.dequantize(torch.float32).contiguous(), name=w.name)


def kernels_available() -> bool:
    try:
        from hybrid.kernels import QPNExpertSlots, qpn_moe  # noqa: F401
    except ImportError:
        return False
    return True


class CardSlots:
    """All slot storage of one card, addressed by the cache's card-global slot ids.

    layer_slots: {layer: (first global slot, slot count)} as the ExpertCache lays them out;
    qtypes: {layer: expert weight QType}. Each layer gets its own storage (the grouped kernel's
    grid then spans only that layer's slots); a layer with 0 slots gets none.
    """

    def __init__(self, device: torch.device, layer_slots: dict[int, tuple[int, int]],
                 qtypes: dict[int, object], hidden: int, inter: int, use_kernels: bool = True,
                 hold_bytes: int = HOLD_BYTES):
        self.device = torch.device(device)
        self.layer_slots = dict(layer_slots)
        self.hold = HoldBudget(hold_bytes)             # CPU card: fp32 slot bytes (module doc)
        self._store = {l: make_store(n, hidden, inter, qtypes[l], self.device, use_kernels, self.hold)
                       for l, (_, n) in self.layer_slots.items() if n > 0}
        self.kinds = sorted({type(g).__name__ for g in self._store.values()})

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot storage (QPN storage; 0 for the reference storage)."""
        total = 0
        for st in self._store.values():
            inner = getattr(st, "slots", None)
            for name in ("w13", "w2", "s13", "s2", "gs"):
                t = getattr(inner, name, None)
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total

    def graph_safe(self, layer: int) -> bool:
        """The layer's hits can be captured in a CUDA graph over every routed pair, absent ones as
        slot -1: no storage (0 slots), or QPN storage on the card (its route kernel drops -1)."""
        st = self._store.get(layer)
        return st is None or (isinstance(st, QPNSlots) and st.host is None)

    def load(self, layer: int, slot: int, weights: Sequence[QWeight], stream=None) -> None:
        self._store[layer].load(self.local(layer, slot), *weights, stream=stream)

    def packed(self, layer: int):
        """The layer's QPNExpertSlots when they are packed storage on the card (what a load from the
        CPU store can write: hybrid.runtime.store_stage.StoreSource.load_slot), else None."""
        st = self._store.get(layer)
        return st.slots if isinstance(st, QPNSlots) and st.host is None else None

    def local(self, layer: int, slot: int) -> int:
        """A card-global slot id -> its index in the layer's storage."""
        return int(slot) - self.layer_slots[layer][0]

    def moe(self, layer: int, x: torch.Tensor, slot_ids: torch.Tensor, token_idx: torch.Tensor,
            route_w: torch.Tensor) -> torch.Tensor:
        """Hits of one layer: x [T, H], global slot_ids/token_idx/route_w [A] -> [T, H] fp32."""
        return self._store[layer].moe(x, slot_ids - self.layer_slots[layer][0], token_idx, route_w)

    def moe_local(self, layer: int, x: torch.Tensor, slot_ids: torch.Tensor, token_idx: torch.Tensor,
                  route_w: torch.Tensor, plan=None) -> torch.Tensor:
        """moe() with slot ids local to the layer's storage (0..its slots - 1) -> [T, H] fp32. plan: their
        RoutePlan (made by the router's launch; packed storage only, see packed())."""
        if plan is None:
            return self._store[layer].moe(x, slot_ids, token_idx, route_w)
        return self._store[layer].moe(x, slot_ids, token_idx, route_w, plan=plan)


def make_store(n: int, hidden: int, inter: int, qtype, device, use_kernels: bool, hold=None):
    """QPN storage when the kernels take this type and shape, else the torch reference storage."""
    if use_kernels and getattr(qtype, "is_quantized", False) and kernels_available():
        try:
            return QPNSlots(n, hidden, inter, qtype, device, hold)
        except ValueError:          # shape the kernels cannot take (e.g. in-features % 64)
            pass
    return TorchExpertSlots(n, device, hold)

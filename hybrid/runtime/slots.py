"""A card's expert-cache slot storage: where the weights of resident experts live and how hits run.

Legend: T tokens, H hidden, I expert intermediate, A (token, expert) pairs that hit, S slots.
The ExpertCache hands out card-global slot ids (each layer owns a contiguous block). Storage is
grouped by weight type: quantized experts (NVFP4/FP8) go to hybrid.kernels.QPNExpertSlots and run
through the grouped qpn_moe kernel (its torch reference on CPU tensors); dense experts (BF16/FP16
checkpoints, or shapes the kernels cannot take) go to TorchExpertSlots, which runs them through
the reference linear path. Each layer has its own storage, indexed from 0.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hybrid.checkpoint.qweight import QWeight
from hybrid.model.linear import Linear

ExpertWeights = Callable[[int, int], tuple[QWeight, QWeight, QWeight]]


class TorchExpertSlots:
    """Reference slot storage (any device, any weight type): one stored SwiGLU per slot."""

    def __init__(self, num_slots: int, device: torch.device):
        self.device = torch.device(device)
        self.slots: list[tuple[Linear, Linear, Linear] | None] = [None] * num_slots

    def load(self, slot: int, gate: QWeight, up: QWeight, down: QWeight, stream=None) -> None:
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            self.slots[slot] = tuple(Linear(w).to(self.device) for w in (gate, up, down))

    def moe(self, x: torch.Tensor, slot_ids, token_idx, route_w) -> torch.Tensor:
        """x [T, H]; slot_ids/token_idx/route_w [A] -> Σ route_w · expert(x) [T, H] fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)     # [T, H]
        for s in torch.unique(slot_ids).tolist():
            sel = slot_ids == s
            rows = token_idx[sel].long()
            g, u, d = self.slots[s]
            xs = x[rows]                                                     # [t_s, H]
            y = d(F.silu(g(xs)) * u(xs))                                     # [t_s, H]
            out.index_add_(0, rows, y.float() * route_w[sel, None].float())
        return out


class QPNSlots:
    """Quantized slot storage through hybrid.kernels (QPN kernel on CUDA, torch reference on CPU)."""

    def __init__(self, num_slots: int, hidden: int, inter: int, qtype, device: torch.device):
        from hybrid.kernels import QPNExpertSlots

        self.slots = QPNExpertSlots(num_slots, hidden, inter, qtype, torch.device(device))

    def load(self, slot: int, gate: QWeight, up: QWeight, down: QWeight, stream=None) -> None:
        self.slots.load(slot, gate, up, down, stream=stream)

    def moe(self, x: torch.Tensor, slot_ids, token_idx, route_w) -> torch.Tensor:
        from hybrid.kernels import qpn_moe

        return qpn_moe(x.to(torch.float16), self.slots, slot_ids.int(), token_idx.int(),
                       route_w.float())


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
                 qtypes: dict[int, object], hidden: int, inter: int, use_kernels: bool = True):
        self.device = torch.device(device)
        self.layer_slots = dict(layer_slots)
        self._store = {l: _make_store(n, hidden, inter, qtypes[l], self.device, use_kernels)
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

    def load(self, layer: int, slot: int, weights: Sequence[QWeight], stream=None) -> None:
        self._store[layer].load(int(slot) - self.layer_slots[layer][0], *weights, stream=stream)

    def moe(self, layer: int, x: torch.Tensor, slot_ids: torch.Tensor, token_idx: torch.Tensor,
            route_w: torch.Tensor) -> torch.Tensor:
        """Hits of one layer: x [T, H], global slot_ids/token_idx/route_w [A] -> [T, H] fp32."""
        return self._store[layer].moe(x, slot_ids - self.layer_slots[layer][0], token_idx, route_w)

    def moe_local(self, layer: int, x: torch.Tensor, slot_ids: torch.Tensor, token_idx: torch.Tensor,
                  route_w: torch.Tensor) -> torch.Tensor:
        """moe() with slot ids local to the layer's storage (0..its slots - 1) -> [T, H] fp32."""
        return self._store[layer].moe(x, slot_ids, token_idx, route_w)


def _make_store(n: int, hidden: int, inter: int, qtype, device, use_kernels: bool):
    """QPN storage when the kernels take this type and shape, else the torch reference storage."""
    if use_kernels and getattr(qtype, "is_quantized", False) and kernels_available():
        try:
            return QPNSlots(n, hidden, inter, qtype, device)
        except ValueError:          # shape the kernels cannot take (e.g. in-features % 64)
            pass
    return TorchExpertSlots(n, device)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

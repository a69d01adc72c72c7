"""CPU mode: the dense weights of a card that is the CPU, held as the card would hold them.

Legend: N out, K in. A real card keeps its dense weights resident in the QPN layout (prepacked
once, hybrid.model.linear.Linear.kernel_weight). The reference linear on the CPU instead
dequantizes the stored weight at every call (hybrid.model.linear), which in CPU mode costs more
than the matmul itself. hold_dense gives each dense Linear of the CPU-card layers (attention
q/k/v/o, a shared expert, and lm_head when it is on the CPU) its weight as fp32 [N, K] once, so
the reference path multiplies by it directly: the same values (dequantize is exact and
deterministic), the same matmul, no per-call decode. Routed experts are never held here (slots:
hybrid.runtime.slots; the rest stay packed in the CPU expert store), and the held bytes are capped
at `budget` (past it, weights stay packed and are decoded per call as before).
"""
from __future__ import annotations

import torch

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.model.linear import Linear

DENSE_HOLD_BYTES = 1 << 30     # fp32 bytes of dense weights a CPU card may hold (1 GiB)


def dense_linears(model) -> list[Linear]:
    """The dense Linears of the model's CPU layers (layer order), then lm_head if on the CPU."""
    out = []
    for i, layer in enumerate(model.layers):
        if model.layer_devices[i].type != "cpu":
            continue
        a = layer.attn
        out += [a.q, a.k, a.v, a.o]
        if layer.shared is not None:
            out += [layer.shared.gate, layer.shared.up, layer.shared.down]
    if model.lm_head.device.type == "cpu":
        out.append(model.lm_head)
    return out


def hold_dense(model, budget: int = DENSE_HOLD_BYTES) -> int:
    """Give the CPU layers' dense Linears fp32 weights, within `budget` bytes -> bytes held."""
    held = 0
    for lin in dense_linears(model):
        w = lin.weight
        if w.qtype is QType.F32 or w.data.device.type != "cpu":
            continue
        n, k = w.shape
        if held + 4 * n * k > budget:
            break
        lin.weight = QWeight(QType.F32, w.shape, w.dequantize(torch.float32).contiguous(), name=w.name)
        held += 4 * n * k
    return held

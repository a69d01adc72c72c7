"""Routing and the expert interface.

Legend: T tokens, H hidden, I expert intermediate, E experts, k experts per token.
The model calls an ExpertExecutor per MoE layer; the reference one runs every routed expert
through the linear interface. The hybrid runtime swaps in GPU-cache + CPU-runner executors.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from hybrid.model.linear import Linear


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk: bool):
    """x [T, H], router_w [E, H] -> (ids [T, k] int64, weights [T, k] fp32). Router math in fp32."""
    logits = x.float() @ router_w.float().T                  # [T, E]
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)          # ties -> lowest index first
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> Σ_k weight · expert(x) [T, H]."""


class SwiGLU:
    """down(silu(gate(x)) * up(x)): one expert or a shared expert."""

    def __init__(self, gate: Linear, up: Linear, down: Linear):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def to(self, device) -> "SwiGLU":
        return SwiGLU(self.gate.to(device), self.up.to(device), self.down.to(device))


class ReferenceExperts:
    """Runs every routed expert through the linear interface; experts fetched lazily per call."""

    def __init__(self, get_expert):
        """get_expert(layer, expert) -> SwiGLU (stored weights; mmap-backed)."""
        self.get_expert = get_expert

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32)                        # [T, H]
        for e in torch.unique(ids).tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)                    # tokens routed to e
            y = self.get_expert(layer, e).to(x.device)(x[rows])              # [t_e, H]
            out.index_add_(0, rows, y.float() * weights[rows, slot, None].float())
        return out.to(x.dtype)

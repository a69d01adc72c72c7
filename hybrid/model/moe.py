"""Routing and the expert interface.

Legend: T tokens, H hidden, I expert intermediate, E experts, k experts per token.
The model calls an ExpertExecutor per MoE layer; the reference one runs every routed expert
through the linear interface. The hybrid runtime swaps in GPU-cache + CPU-runner executors.
"""
from __future__ import annotations

from typing import Callable, Protocol

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


def expert_sum(x: torch.Tensor, expert_ids: torch.Tensor, token_idx: torch.Tensor, route_w: torch.Tensor,
               expert: Callable[[int], Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Σ route_w · expert(x) over routed (token, expert) pairs, one expert call per distinct expert.

    x [T, H]; expert_ids/token_idx/route_w [A] (a token at most once per expert); expert(e) -> a
    SwiGLU or any [t, H] -> [t, H] callable. Experts in ascending id order, each one's tokens in
    pair order -> [T, H] fp32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)          # [T, H]
    for e in torch.unique(expert_ids).tolist():
        sel = expert_ids == e                                                 # [A]
        rows = token_idx[sel].long()                                          # tokens routed to e
        y = expert(e)(x[rows])                                                # [t_e, H]
        out.index_add_(0, rows, y.float() * route_w[sel, None].float())
    return out


class ReferenceExperts:
    """Runs every routed expert through the linear interface; experts fetched lazily per call."""

    def __init__(self, get_expert):
        """get_expert(layer, expert) -> SwiGLU (stored weights; mmap-backed)."""
        self.get_expert = get_expert

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        tokens = torch.arange(T, device=ids.device).repeat_interleave(k)      # [T*k], row-major as ids
        out = expert_sum(x, ids.reshape(-1), tokens, weights.reshape(-1),
                         lambda e: self.get_expert(layer, e).to(x.device))
        return out.to(x.dtype)

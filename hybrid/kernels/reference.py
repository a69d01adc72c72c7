"""Torch references for the QPN kernels (CPU mode and tests): dequantize one weight transiently,
multiply in fp32. Legend: M rows, N out, K in, T tokens, H hidden, A assignments."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.checkpoint.qweight import QWeight


def ref_linear(x: torch.Tensor, qw: QWeight) -> torch.Tensor:
    """x [M, K] fp16 -> [M, N] fp16, computed in fp32."""
    return (x.float() @ qw.dequantize(torch.float32).t()).to(torch.float16)


def ref_expert(x: torch.Tensor, gate: QWeight, up: QWeight, down: QWeight,
               round_h: bool = True) -> torch.Tensor:
    """x [R, H] fp16 -> [R, H] fp32: down(silu(gate x) * up x); h rounded to fp16 like the kernel."""
    xf = x.float()
    hmid = F.silu(xf @ gate.dequantize().t()) * (xf @ up.dequantize().t())  # [R, I]
    if round_h:
        hmid = hmid.half().float()
    return hmid @ down.dequantize().t()


def ref_moe(x: torch.Tensor, experts: list, slot_ids: torch.Tensor, token_idx: torch.Tensor,
            route_w: torch.Tensor) -> torch.Tensor:
    """y [T, H] fp32 = sum over assignments a of route_w[a] * expert_{slot_ids[a]}(x[token_idx[a]])."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    sid = slot_ids.long().cpu()
    groups = ((s, (sid == s).nonzero().flatten()) for s in sid.unique().tolist())
    return _add_groups(y, x, experts, groups, token_idx, route_w, "slot_ids")


def ref_moe_planned(x: torch.Tensor, experts: list, plan, token_idx: torch.Tensor,
                    route_w: torch.Tensor) -> torch.Tensor:
    """ref_moe over a RoutePlan's groups, as the kernels read them: for each active slot s (until -1),
    the assignments perm[offsets[s]:offsets[s + 1]] -> plan.y [T, H] fp32 (accumulated into it)."""
    offsets, perm = plan.offsets.long().cpu(), plan.perm.long().cpu()
    active = plan.active.tolist()
    active = active[: active.index(-1)] if -1 in active else active
    groups = ((s, perm[offsets[s]:offsets[s + 1]]) for s in active)
    return _add_groups(plan.y, x, experts, groups, token_idx, route_w, "plan")


def _add_groups(y: torch.Tensor, x: torch.Tensor, experts: list, groups, token_idx: torch.Tensor,
                route_w: torch.Tensor, what: str) -> torch.Tensor:
    """y += route_w[sel] * expert_s(x[token_idx[sel]]) for each (slot s, assignment indices sel) of groups."""
    tok = token_idx.long().cpu()
    for s, sel in groups:
        if not 0 <= s < len(experts) or not isinstance(experts[s], tuple):
            raise ValueError(f"{what}: slot {s} is empty or out of range")
        rows = tok[sel].to(x.device)
        out = ref_expert(x[rows], *experts[s])
        y.index_add_(0, rows, out * route_w[sel.to(x.device)].unsqueeze(1))
    return y

"""The grouped MoE kernels' routing, made by the router's launch (one launch per decode layer fewer).

qpn_moe groups a layer's A = T * k (slot, token row, weight) assignments by slot before its expert
kernels run: offsets [S+1] (each slot's rows), perm [A] (the assignments grouped by slot), active
[min(A, S)] (the slots with work, ascending, -1 after), and the output y [T, H] fp32 zeroed. On its own
that is one more launch (qpn_moe_route). fused.add_norm_router's kernel can make all of it in its last
block, from the slot ids it has just looked up, when it is given a RoutePlan; qpn_moe then takes the
plan and launches only the expert kernels.

    plan = RoutePlan.new(t, k, s, h, device)            # graph-static buffers (per layer), t * k <= 32
    fused.add_norm_router(..., slot_table, slots, row, plan=plan)   # sets plan.made
    y = qpn_moe(x, experts, slots, token_idx, route_w, plan=plan)   # uses and clears plan.made

`made` is a host flag set by the launch that wrote the plan and cleared by the one that used it, so a
router path that cannot write it (another kernel, more tokens) leaves qpn_moe to route as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


MAX_ASSIGNMENTS = 32      # t * k: the router kernel's plan is one warp's (a lane per assignment)


@dataclass
class RoutePlan:
    """Buffers of one layer's routing for t tokens x k experts over s slots, hidden h (see module doc)."""

    offsets: torch.Tensor      # [s + 1] int32: only the entries of slots with work are written
    perm: torch.Tensor         # [t * k] int32
    active: torch.Tensor       # [min(t * k, s)] int32
    y: torch.Tensor            # [t, h] fp32, zeroed by the router's launch
    slots: int
    made: bool = False

    @staticmethod
    def fits(t: int, k: int) -> bool:
        """Whether the router's launch can make the plan of t tokens x k experts (t * k <= 32)."""
        return t * k <= MAX_ASSIGNMENTS

    @classmethod
    def new(cls, t: int, k: int, s: int, h: int, device) -> RoutePlan:
        if not cls.fits(t, k):
            raise ValueError(f"RoutePlan: {t} tokens x {k} experts, at most {MAX_ASSIGNMENTS} assignments")
        a = t * k
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.zeros(s + 1, **i32), torch.zeros(a, **i32), torch.zeros(min(a, s), **i32),
                   torch.zeros(t, h, dtype=torch.float32, device=device), s)

    def check(self, a: int, t: int, h: int, s: int) -> None:
        """ValueError unless the buffers fit a = t * k assignments, hidden h and s slots."""
        want = {"offsets": (s + 1,), "perm": (a,), "active": (min(a, s),), "y": (t, h)}
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"plan.{name}: expected shape {shape}, got {got}")
        if self.slots != s:
            raise ValueError(f"plan: made for {self.slots} slots, the experts have {s}")

    def fill_ref(self, slot_ids: torch.Tensor) -> None:
        """The kernel's outputs made by torch (CPU mode, tests): offsets / perm / active from slot_ids [A]
        (ids outside [0, slots) dropped), y zeroed; sets made."""
        offsets, perm, active = ref_route_plan(slot_ids, self.slots)
        kept = sorted(set(active.tolist()) - {-1})
        for s in kept:                                    # the entries the kernel writes
            self.offsets[s:s + 2] = offsets[s:s + 2].to(self.offsets.device)
        self.perm[: perm.numel()] = perm.to(self.perm.device)
        self.active.copy_(active.to(self.active.device))
        self.y.zero_()
        self.made = True


def ref_route_plan(slot_ids: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slot_ids [A] -> (offsets [s+1], perm [A'] of the kept assignments grouped by slot, ascending, each
    slot's in assignment order, active [min(A, s)]): what qpn_moe_route and the router's plan make."""
    ids = slot_ids.long().cpu()
    a = ids.numel()
    keep = (ids >= 0) & (ids < s)
    counts = torch.bincount(ids[keep], minlength=s)                       # [s]
    offsets = torch.zeros(s + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    order = torch.arange(a)[keep]
    perm = order[torch.argsort(ids[keep], stable=True)].to(torch.int32)   # stable: assignment order
    used = counts.nonzero().flatten().to(torch.int32)
    active = torch.full((min(a, s),), -1, dtype=torch.int32)
    active[: used.numel()] = used
    return offsets, perm, active

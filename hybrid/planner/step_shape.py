"""What one decode step of the runtime launches, counted per layer: the planner's kernel-count terms.

These are facts about the runtime's code (hybrid/model/qwen_moe.py decode_dense, Attention.decode,
hybrid/runtime/hybrid_experts.py moe_device / __call__, hybrid/runtime/graphs.py), not about the
hardware; the profile gives what one kernel or one op costs (gpus[].graph_kernel_us, launch_us).

    dense_kernels   rope rows, 2 x RMSNorm (cast, norm, cast), fused q/k/v QPN, q/k norm, RoPE,
                    2 KV index_copy_, masked SDPA, o QPN, residual, router (cast, GEMV, softmax,
                    top-k, renormalise), route-buffer copies: ~34 small kernels
    expert_kernels  the grouped QPN kernel's route, gate/up and down launches: 3 (measured on the H200,
                    30B-A3B shape, every expert resident: qpn_moe_route, qpn2_moe_gateup_mt1_as and
                    qpn2_moe_down_mt1_as 48 launches each per graphed step, nothing else per layer's
                    experts; results/runtime.md section 27.5; the slot-id lookup rides in the router
                    kernel, the weighted sum in the down kernel, the residual in the next add + norm).
                    It was ~8 from the eager torch ops (slot-id gather, weight cast, the 3, cast,
                    residual) before those moved into the fused kernels.
    resident_expert_kernels  the same for a layer whose experts are all resident, in a graphed step:
                    2 where the router's launch makes the route (hybrid.kernels.moe_route.RoutePlan,
                    HYBRID_FUSED_NEW part "plan", up to 32 experts per token; measured on the H200:
                    no qpn_moe_route launch left per graphed step, results/runtime.md section 28.2),
                    else expert_kernels. A can-miss layer keeps the route launch.
    head_kernels    final RMSNorm (3) + lm_head + fp32 cast: 5
    eager_ops       a layer that can miss runs its MoE eagerly after the host sync (the sync and the
                    lookup are their own terms): the graph's packed ids/weights/x row copied down
                    (1), the hits' (slot, token, weight) copied up (1), 2 timing events, the grouped
                    kernel's zero/route/gate-up/down launches (4), CPU result up + add (2), cast (1),
                    residual (1), next segment's input copy + replay (2): ~14 (~20 before the
                    graph packed the row and the host made the hit list: 4 casts/concat, a weight
                    gather + cast, a slot offset and two int casts fewer)
    miss_nodes      with the hits inside the decode graph (HYBRID_MISS_GRAPH, the default) such a
                    layer's eager ops become 2 host operations (replay, event wait:
                    hybrid.runtime.graphs.MISS_LAYER_HOST_OPS) and ~14 graph nodes: 2 row copies, the
                    copy to pinned memory, the event, the grouped kernel's launches, 2 saves and the
                    next graph's CPU-sum copy up / add / cast / add (3 host operations and 13 nodes
                    before the copy up moved into the graph). Measured on the H200 (1024 slots,
                    30B-A3B shape): CUDA calls per step 699 -> 178, decode 25.4-32.4 -> 93.8-108.1 tok/s.
                    Charged: 4, the 2 saves, the cast and the add (MissLink.keep / combine). The
                    profile's link_us (calibrate's MissLink round trip) already holds the row copies,
                    the copy to pinned memory, the event, the copy up and its add, and the grouped
                    kernel's launches are expert_kernels; 14 counted those twice (the planner predicted
                    the 1024-slot H200 decode at 154.6 tok/s where 192-207 were measured; the extra GPU
                    time of that path over the all-resident one is 13.4 us per layer beside its route
                    launch, torch.profiler: results/runtime.md section 28.3).
    fused_dense     every fused part of the dense step is in effect (decode_shape: route, norm,
                    rope_attn): the dense part's kernels are the profile's fused_layer_us plus
                    DENSE_QPN launches where it has that figure (predict.dense_fixed_us).
The counts were estimated from the code; tools/gpu_runtime_check.py counts the kernels of one
eager step on the device (results/runtime.md) to check them. In a graphed step the dense part is 5
launches (fused add + norm + router, fused rope + attention, q/k/v and o QPN, add + norm) that took 31.7
us per layer on the H200 (section 27.5) against the 34 us the planner charges with dense_kernels (13 x
graph_kernel_us + bytes at kernel_efficiency): the fused kernels are latency-bound beyond one small
kernel's cost, so dense_kernels stays a count of small-kernel equivalents where the profile has no
measured gpus[].fused_layer_us; with it (calibrate times those kernels between the QPN kernels, as
the runtime launches them: on sm_90 programmatic dependent launches that a small-kernel mix does not
see) a layer whose step runs every fused part (fused_dense) is charged that figure instead.

The fused decode kernels (hybrid.kernels.fused, HYBRID_FUSED) each replace several of the dense
kernels with one launch; `decode_shape()` subtracts what the parts in effect save. Per part, from
the code: rope (q/k RMSNorm + RoPE + 2 KV copies) 9, route (cast, GEMV, softmax, top-k,
renormalise) 4, norm (2 x cast/norm/cast) 4, attn (mask + SDPA) 4, rope_attn both rope and attn
+ 1. Measured on the H200 (one eager step, torch.profiler): 36.1 kernels per layer with the torch
ops (febda33), 23.1 with rope + route (da35ee4): 13 fewer, as rope + route predict.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepShape:
    dense_kernels: int = 34
    expert_kernels: int = 3
    resident_expert_kernels: int = 3
    head_kernels: int = 5
    eager_ops: int = 14
    miss_nodes: int = 0
    fused_dense: bool = False

    def __post_init__(self) -> None:
        if min(self.dense_kernels, self.expert_kernels, self.resident_expert_kernels, self.head_kernels,
               self.eager_ops, self.miss_nodes) < 0:
            raise ValueError("kernel and op counts must be >= 0")


DECODE = StepShape()


FUSED_SAVES = {"rope": 9, "route": 4, "norm": 4, "attn": 4}
# the most experts per token whose route the router's launch makes in a decode step (one token):
# hybrid.kernels.moe_route.MAX_ASSIGNMENTS, kept here so the planner needs no torch (a test checks they agree)
ROUTE_PLAN_MAX_K = 32
MISS_GRAPH = {"eager_ops": 2, "miss_nodes": 4}    # a can-miss layer with its hits in the graph
# With every fused part of a layer's dense step in effect (fused_dense: add + norm, rope + attention,
# add + norm + router), a profile that measured those kernels' time per layer (gpus[].fused_layer_us) is
# charged instead of dense_kernels small kernels, plus the layer's two dense QPN launches (q/k/v, o) at
# graph_kernel_us each, as calibrate's kernel_efficiency counts them.
DENSE_QPN = 2


def decode_shape() -> StepShape:
    """DECODE less the kernels that the fused parts in effect (HYBRID_FUSED) replace, with the
    can-miss layers' shape of the path in effect (HYBRID_MISS_GRAPH) and a resident layer's route made
    by its router launch where that is on (HYBRID_FUSED_NEW router + plan)."""
    from hybrid.kernels.fused import enabled, new_kernel
    from hybrid.runtime.graphs import miss_graph_enabled

    saved = sum(n for part, n in FUSED_SAVES.items() if enabled(part))
    if enabled("rope_attn") and not (enabled("rope") and enabled("attn")):
        saved += FUSED_SAVES["rope"] + FUSED_SAVES["attn"] - 1 - sum(
            FUSED_SAVES[p] for p in ("rope", "attn") if enabled(p))
    shape = replace(DECODE, dense_kernels=max(1, DECODE.dense_kernels - saved))
    if enabled("route") and new_kernel("router") and new_kernel("plan"):
        shape = replace(shape, resident_expert_kernels=DECODE.expert_kernels - 1)
    if enabled("route") and enabled("norm") and enabled("rope_attn"):
        shape = replace(shape, fused_dense=True)
    return replace(shape, **MISS_GRAPH) if miss_graph_enabled() else shape

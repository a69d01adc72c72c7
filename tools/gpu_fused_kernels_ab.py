"""Older vs newer fused decode kernels, per kernel, at decode shapes (no checkpoint needed).

Each launch of a graph gets its own weights and KV store (as the layers of a model: nothing is found
in L2 from the previous launch); L launches are captured as ONE CUDA graph per (kernel, setting, shape)
and replayed; every replay is timed by its own pair of CUDA events; the record gives the median and
the minimum us per launch. Settings (HYBRID_FUSED_NEW at capture time, hybrid.kernels.fused):
    norm    add_rms_norm: x [T, H] fp16 + delta fp16 or fp32 (the MoE output) -> RMSNorm, T = 1, 8:
            old = fused_add_rms_norm, new = fused_add_rms_norm_e
    router  add_norm_router: x [T, H] fp16 + attention output fp16 -> RMSNorm -> router [E, H] fp32 ->
            softmax / top-k (+ the runtime's slot ids and route row), T = 1..8:
            old = fused_add_norm_router (a warp per expert), new = fused_add_norm_router_e; also new_bare
            (no slot ids / route row), new_plan (+ the MoE routing, RoutePlan) and qpn_moe_route alone;
            --router-context: each launch after an o_proj-shaped QPN linear that makes its delta (in_context,
            in_context_plan: the pair's time less the linears' alone), the model's order and DRAM traffic
    attn    rope_attn: Hq / Hkv / D heads, one token at device position p, keys = p + 1 rounded up to
            256 (the graph bucket): old = fused_rope_attn, new = fused_rope_attn_e, each at several
            fused.ATT_MIN_ROUNDS (rounds per split at least)
Correctness beside each record: the new kernel's outputs against the old one's and the torch reference
(router: ids equal to the reference's top-k of the h written, weights max diff; attention: max abs
diff to the fp32 reference). One JSON line per record on stdout (appended to $OUT/fused_kernels_ab.jsonl
when $OUT is set).

    PYTHONPATH=. python3 tools/gpu_fused_kernels_ab.py [--what router attn] [--launches 48]
    python3 tools/gpu_fused_kernels_ab.py --device cpu --launches 2    # a dry run (the references)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from hybrid.kernels import fused
from hybrid.kernels.moe_route import RoutePlan
from hybrid.model.layers import Rotary

EPS = 1e-6


def timed(fn, replays: int, cuda: bool) -> tuple[float, float]:
    """(median, min) us per replay of fn captured as one CUDA graph (each replay timed by events)."""
    if not cuda:
        fn()
        return 0.0, 0.0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    us = [a.elapsed_time(b) * 1000 for a, b in ev]
    return statistics.median(us), min(us)


def cupti_means(fn, replays: int) -> dict:
    """Mean device time per launch by kernel name (torch.profiler / CUPTI: each kernel's own start to end, as
    the in-model profiles report it) over `replays` replays of fn captured as one CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and e.count:
            out[e.key[:60]] = round(us / e.count, 3)
    return out


PLAN_DEFAULTS = (fused.ATT_MIN_ROUNDS, fused.ATT_COMBINE_Q, fused.ATT_BLOCKS_PER_SM)


def _setting(new: bool, min_rounds: int | None = None, combine_q: int | None = None, per_sm: float | None = None):
    os.environ["HYBRID_FUSED_NEW"] = "all" if new else "0"
    mr, cq, bps = PLAN_DEFAULTS
    fused.ATT_MIN_ROUNDS = mr if min_rounds is None else min_rounds
    fused.ATT_COMBINE_Q = cq if combine_q is None else combine_q
    fused.ATT_BLOCKS_PER_SM = bps if per_sm is None else per_sm


# ---------------------------------------------------------------------------- router
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


def router_inputs(t: int, h: int, e: int, k: int, n: int, dev, seed: int) -> dict:
    """n launches' own router inputs (x, norm weight, router) and the runtime's outputs (slot ids, route row,
    a RoutePlan where t * k fits one, else None), a shared expert -> slot table, and the seeded `rnd`."""
    g = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=dev) * scale  # noqa: E731
    dt = torch.float16 if dev.type == "cuda" else torch.float32
    return {"rnd": rnd, "dt": dt, "xs": [rnd(t, h).to(dt) for _ in range(n)],
            "ws": [1 + rnd(h, scale=0.1) for _ in range(n)],
            "routers": [rnd(e, h, scale=3.0 / h ** 0.5) for _ in range(n)],
            "table": torch.randperm(e, device=dev).to(torch.int32),
            "slots": [torch.zeros(t * k, dtype=torch.int32, device=dev) for _ in range(n)],
            "rows": [torch.zeros(t, 2 * k, device=dev) for _ in range(n)],
            "plans": [RoutePlan.new(t, k, e, h, dev) if RoutePlan.fits(t, k) else None for _ in range(n)]}


def set_carveout(dev, percent: int) -> list[str]:
    """Every kernel the fused and QPN modules of dev have handed out so far: preferred shared-memory carveout
    = percent of the SM's L1 / shared pool (cuFuncSetAttribute) -> their names."""
    from hybrid.kernels import qpn
    from hybrid.kernels.driver import _cuda, check

    names = []
    for mod in (fused._module(dev), qpn._module(dev)):
        with torch.cuda.device(dev):
            for name, fn in mod._funcs.items():
                check(_cuda().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent),
                      f"cuFuncSetAttribute({name}, carveout {percent})")
                names.append(name)
    return names


def router_context(t: int, h: int, e: int, k: int, n: int, dev, replays: int, carveouts=(),
                   cupti: bool = False, kmul: int = 2) -> list[dict]:
    """The router as the model runs it: each of the n launches right after an o_proj-shaped NVFP4 QPN linear
    ([1, kmul h] -> [1, h] (kmul 2: o_proj's shape; larger: as many bytes as a layer's experts stream between
    two routers), its own weight: kmul h * h / 2 bytes, so the graph streams n of them and the routers come
    from DRAM, as between the model's layers) whose output is the router's delta. Graphs: the linears alone,
    linear + router, linear + router with the RoutePlan; router in context = (pair - linear) / n. Then again
    with every kernel's preferred shared-memory carveout set to each of carveouts (% of the pool; a kernel
    boundary between different carveouts makes the SM reconfigure). cupti: each record also gets the kernels'
    mean device time per launch as the profiler reports it (`cupti_us`: the in-model profiles' measure)."""
    from hybrid.checkpoint.formats import QType, quantize_nvfp4
    from hybrid.checkpoint.qweight import QWeight
    from hybrid.kernels.qpn import QPNWeight, qpn_linear

    r = router_inputs(t, h, e, k, n, dev, 1000 + t)
    xs, norms, routers, table, slots, rows, plans = (r[key] for key in ("xs", "ws", "routers", "table", "slots",
                                                                         "rows", "plans"))
    p, sc, s2 = quantize_nvfp4(torch.randn(h, kmul * h, generator=torch.Generator().manual_seed(t)))
    qw = QWeight(QType.NVFP4, (h, kmul * h), p, sc, s2)
    lin_ws = [QPNWeight.from_qweight(qw, dev) for _ in range(n)]
    attn = [r["rnd"](t, kmul * h).half() for _ in range(n)]

    def linears():
        return [qpn_linear(attn[i], lin_ws[i]) for i in range(n)]

    def pairs(plan: bool, touch: bool = False):
        def run():
            for i in range(n):
                d = qpn_linear(attn[i], lin_ws[i]).to(r["dt"])
                if touch:                         # the router's inputs into the L2 first (their own kernels)
                    for a in (routers[i], norms[i], xs[i]):
                        a.sum()
                fused.add_norm_router(xs[i], norms[i], EPS, routers[i], k, True, d, table, slots[i], rows[i],
                                      plan=plans[i] if plan else None)
        return run

    _setting(True)
    cuda = dev.type == "cuda"
    recs = []
    for carve in (None, *carveouts):
        if carve is not None and cuda:
            set_carveout(dev, carve)
        lin, _ = timed(linears, replays, cuda)
        settings = [("in_context", pairs(False)), ("in_context_plan", pairs(True))]
        if cupti:                                 # router's data L2-hot, its code as the linear left it
            settings.append(("in_context_touched", pairs(False, True)))
        for name, fn in settings:
            if name == "in_context_plan" and plans[0] is None:
                continue
            med, mn = timed(fn, replays, cuda)
            rec = {"kernel": "add_norm_router", "setting": name, "T": t, "H": h, "E": e, "k": k,
                   "launches": n, "carveout": carve, "context_k": kmul * h, "linear_us_per_launch": round(lin / n, 3),
                   "pair_us_per_launch": round(med / n, 3), "us_per_launch_median": round((med - lin) / n, 3)}
            if name == "in_context_touched":          # its pair time holds the three reads too: see cupti_us
                rec["pair_includes"] = "sum() of the router, norm weight and x (own kernels)"
            if cupti and cuda:
                rec["cupti_us"] = cupti_means(fn, max(3, replays // 5))
            recs.append(rec)
    return recs


def router_case(t: int, h: int, e: int, k: int, n: int, dev, replays: int) -> list[dict]:
    r = router_inputs(t, h, e, k, n, dev, t)
    xs, ws, routers, table, slots, rows, plans = (r[key] for key in ("xs", "ws", "routers", "table", "slots",
                                                                      "rows", "plans"))
    ds = [r["rnd"](t, h, scale=0.5).to(r["dt"]) for _ in range(n)]
    outs: dict = {}

    def run():
        return [fused.add_norm_router(xs[i], ws[i], EPS, routers[i], k, True, ds[i], table, slots[i], rows[i])
                for i in range(n)]

    def bare():                                   # no slot ids, no route row
        return [fused.add_norm_router(xs[i], ws[i], EPS, routers[i], k, True, ds[i]) for i in range(n)]

    def planned():                                # + the grouped MoE kernels' routing (RoutePlan)
        return [fused.add_norm_router(xs[i], ws[i], EPS, routers[i], k, True, ds[i], table, slots[i], rows[i],
                                      plan=plans[i]) for i in range(n)]

    recs = []
    for name, new, fn in (("old", False, run), ("new", True, run), ("new_bare", True, bare),
                          ("new_plan", True, planned)):
        if name == "new_plan" and plans[0] is None:          # t * k past one warp's plan: none made
            continue
        _setting(new)
        med, mn = timed(fn, replays, dev.type == "cuda")
        if name in ("old", "new"):
            outs[name] = run()
        recs.append({"kernel": "add_norm_router", "setting": name, "T": t, "H": h, "E": e, "k": k, "launches": n,
                     "us_per_launch_median": round(med / n, 3), "us_per_launch_min": round(mn / n, 3)})
    if dev.type == "cuda":                        # qpn_moe's own route launch, what the plan replaces
        from hybrid.kernels import qpn

        mod = qpn._module(dev)
        offs = [torch.empty(e + 1, dtype=torch.int32, device=dev) for _ in range(n)]
        perms = [torch.empty(t * k, dtype=torch.int32, device=dev) for _ in range(n)]
        acts = [torch.empty(min(t * k, e), dtype=torch.int32, device=dev) for _ in range(n)]
        ys = [torch.empty(t, h, device=dev) for _ in range(n)]

        def route():
            for i in range(n):
                mod.launch("qpn_moe_route", (1, 1, 1), 1024,
                           [qpn._p(slots[i]), qpn.ctypes.c_int(t * k), qpn.ctypes.c_int(e), qpn._p(offs[i]),
                            qpn._p(perms[i]), qpn._p(acts[i]), qpn._p(ys[i]), qpn.ctypes.c_int(t * h)])

        med, mn = timed(route, replays, True)
        recs.append({"kernel": "qpn_moe_route", "setting": "route", "T": t, "H": h, "E": e, "k": k, "launches": n,
                     "us_per_launch_median": round(med / n, 3), "us_per_launch_min": round(mn / n, 3)})
    old, new = outs["old"], outs["new"]
    ids_ref = ids_eq_old = 0
    wdiff = hdiff = 0.0
    x_eq = True
    for (x2o, ho, io, wo), (x2n, hn, i_n, wn) in zip(old, new):
        x_eq &= bool(torch.equal(x2o, x2n))
        hdiff = max(hdiff, float((ho.float() - hn.float()).abs().max()))
        ids_eq_old += int(torch.equal(io, i_n))
        wdiff = max(wdiff, float((wo - wn).abs().max()))
    for i, (_, hn, i_n, wn) in enumerate(new):
        rid, rw = fused.ref_router_topk(hn, routers[i], k, True)
        ids_ref += int(torch.equal(i_n, rid))
        wdiff = max(wdiff, float((wn - rw).abs().max()))
    check = {"x2_equal_old": x_eq, "h_max_diff_old": hdiff, "ids_equal_old": f"{ids_eq_old}/{n}",
             "ids_equal_ref": f"{ids_ref}/{n}", "weights_max_diff": wdiff}
    recs[1].update(check)
    return recs


# ---------------------------------------------------------------------------- add + RMSNorm
def norm_case(t: int, h: int, n: int, dev, replays: int, delta_f32: bool) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(100 + t)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=dev) * scale
    dt = torch.float16 if dev.type == "cuda" else torch.float32
    xs = [rnd(t, h).to(dt) for _ in range(n)]
    ds = [rnd(t, h, scale=0.5).to(torch.float32 if delta_f32 else dt) for _ in range(n)]
    ws = [1 + rnd(h, scale=0.1) for _ in range(n)]

    def run():
        return [fused.add_rms_norm(xs[i], ws[i], EPS, ds[i]) for i in range(n)]

    recs, outs = [], []
    for name, new in (("old", False), ("new", True)):
        _setting(new)
        med, mn = timed(run, replays, dev.type == "cuda")
        outs.append(run())
        recs.append({"kernel": "add_rms_norm", "setting": name, "T": t, "H": h, "delta": "fp32" if delta_f32 else "fp16",
                     "launches": n, "us_per_launch_median": round(med / n, 3), "us_per_launch_min": round(mn / n, 3)})
    recs[1]["x2_equal_old"] = all(bool(torch.equal(a[0], b[0])) for a, b in zip(*outs))
    recs[1]["h_max_diff_old"] = max(float((a[1].float() - b[1].float()).abs().max()) for a, b in zip(*outs))
    return recs


# ---------------------------------------------------------------------------- attention
def attn_case(p: int, hq: int, hkv: int, d: int, cap: int, n: int, dev, replays: int, rounds: list[int],
              extra: list[str]) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(p)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=dev) * scale
    qkvs = [rnd(1, (hq + 2 * hkv) * d).half() for _ in range(n)]
    qn, kn = 1 + rnd(d, scale=0.1), 1 + rnd(d, scale=0.1)
    table = Rotary(d, 1e6).table(dev, cap)
    ks = [rnd(cap, hkv, d).half() for _ in range(n)]
    vs = [rnd(cap, hkv, d).half() for _ in range(n)]
    keys = min(-(-(p + 1) // 256) * 256, cap)
    pos = torch.tensor([p], device=dev)

    def run():
        return [fused.rope_attn(qkvs[i], qn, kn, table, ks[i], vs[i], hq, hkv, d, EPS, keys, pos=pos)
                for i in range(n)]

    want = fused.ref_rope_attn(qkvs[0].cpu(), qn.cpu(), kn.cpu(), table.cpu(), ks[0].float().cpu(),
                               vs[0].float().cpu(), hq, hkv, d, EPS, keys, start=p).float()
    recs, base = [], None
    sms = fused._sm_count(dev) if dev.type == "cuda" else 132
    plans = [("old", False, mr, None, None) for mr in rounds] + [("new", True, mr, None, None) for mr in rounds]
    for x in extra:
        mr, cq, bps = x.split(":")
        plans.append(("new", True, int(mr), int(cq), float(bps)))
    for name, new, mr, cq, bps in plans:
        _setting(new, mr, cq, bps)
        med, mn = timed(run, replays, dev.type == "cuda")
        out = run()
        s, r, rk, _ = fused.attn_plan(keys, hkv, hq // hkv, d, sms)
        rec = {"kernel": "rope_attn", "setting": name, "min_rounds": mr, "combine_q": fused.ATT_COMBINE_Q,
               "blocks_per_sm": fused.ATT_BLOCKS_PER_SM, "pos": p, "keys": keys,
               "heads": [hq, hkv, d], "plan": {"splits": s, "rounds": r, "keys_per_round": rk},
               "splits_with_keys": -(-(p + 1) // (r * rk)), "launches": n,
               "us_per_launch_median": round(med / n, 3), "us_per_launch_min": round(mn / n, 3),
               "max_abs_diff_ref": float((out[0].float().cpu() - want).abs().max())}
        if base is None:
            base = out
        else:
            rec["max_abs_diff_old"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, base))
        recs.append(rec)
    _setting(False)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", nargs="+", default=["norm", "router", "attn"], choices=["norm", "router", "attn"])
    ap.add_argument("--launches", type=int, default=48, help="launches per graph, each on its own data (default 48)")
    ap.add_argument("--replays", type=int, default=30, help="timed graph replays (default 30)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8], help="router: tokens T (default 1 2 4 8)")
    ap.add_argument("--router", type=int, nargs=3, default=[2048, 128, 8], metavar=("H", "E", "K"),
                    help="router: hidden, experts, experts per token (default 2048 128 8)")
    ap.add_argument("--pos", type=int, nargs="+", default=[15, 80, 255, 1000, 2047, 4095],
                    help="attention: decode positions (default 15 80 255 1000 2047 4095)")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 4, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--ctx", type=int, default=4096, help="attention: KV rows (default 4096)")
    ap.add_argument("--min-rounds", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="attention: fused.ATT_MIN_ROUNDS values tried (default 1 2 4 8)")
    ap.add_argument("--attn-extra", nargs="*", default=["1:65536:2.0", "1:131072:4.0"],
                    help="attention: more plans of the new kernel as MIN_ROUNDS:COMBINE_Q:BLOCKS_PER_SM")
    ap.add_argument("--router-context", action="store_true",
                    help="router: also time it after an o_proj-shaped QPN linear per launch (as in the model)")
    ap.add_argument("--carveout", type=int, nargs="*", default=[],
                    help="--router-context: then again with every kernel's preferred shared-memory carveout at "
                         "each of these %% (0..100; after the driver's default)")
    ap.add_argument("--context-k", type=int, default=2,
                    help="--router-context: the linear's K in hidden sizes (2: o_proj; 12: ~a layer's expert bytes)")
    ap.add_argument("--cupti", action="store_true",
                    help="--router-context: also each kernel's device time per launch as torch.profiler reports it")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of this script)")
    args = ap.parse_args(argv)
    from hybrid.baselines.report import append_jsonl, stamp

    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none"
    st = {**stamp("tools/gpu_fused_kernels_ab.py"), "gpu": gpu}
    if os.environ.get("HYBRID_GIT_SHA"):                     # the device copy has no .git
        st["git_sha"] = os.environ["HYBRID_GIT_SHA"]
    recs = []
    todo = []
    if "norm" in args.what:
        todo += [lambda t=t, f=f: norm_case(t, args.router[0], args.launches, dev, args.replays, f)
                 for t in (1, 8) for f in (False, True)]
    if "router" in args.what:
        h, e, k = args.router
        todo += [lambda t=t: router_case(t, h, e, k, args.launches, dev, args.replays) for t in args.tokens]
        if args.router_context:
            todo += [lambda t=t: router_context(t, h, e, k, args.launches, dev, args.replays, args.carveout,
                                                args.cupti, args.context_k) for t in args.tokens]
    if "attn" in args.what:
        hq, hkv, d = args.heads
        todo += [lambda p=p: attn_case(p, hq, hkv, d, args.ctx, args.launches, dev, args.replays, args.min_rounds,
                                       args.attn_extra) for p in args.pos]
    for job in todo:
        for r in job():
            r = {**r, **st}
            print(json.dumps(r), flush=True)
            recs.append(r)
    if os.environ.get("OUT"):
        append_jsonl(Path(os.environ["OUT"]) / "fused_kernels_ab.jsonl", recs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One-token attention on a GPU: the fused kernels (hybrid.kernels.fused decode_attn, rope_attn) against
torch SDPA with the additive decode mask (Attention._sdpa1, what they replace), per launch.

L layers' KV stores [C, Hkv, D] fp16 (separate memory, as in a model: no layer finds its K/V in L2 from
the previous one), one launch per layer captured as ONE CUDA graph per (variant, position); device
position pos, keys = pos + 1 rounded up to 256 (the graph bucket of hybrid.model.layers.attn_keys).
Per record: GPU us per launch (CUDA events over graph replays), the split plan, the max abs difference
to the fp32 reference. One JSON line per record on stdout as measured (all of them, stamped, appended
to $OUT/attn_bench.jsonl when $OUT is set). --sweep also times the fused kernels under other split
plans (the tuning knobs hybrid.kernels.fused.ATT_PASSES, ATT_BLOCKS_PER_SM, ATT_COMBINE_Q), each
record naming its knobs. --fused-new times rope_attn under each HYBRID_FUSED_NEW value given (e.g. the default
set and "all", which runs fused_rope_attn_w), --w-per-sm under each fused.ATT_W_BLOCKS_PER_SM (the wide kernel's
plan); rope_attn records carry the max abs difference of layer 0's output to the fp32 reference.

    PYTHONPATH=. python3 tools/gpu_attn_bench.py [--pos 300 3000] [--layers 48] [--heads 32 4 128] [--sweep]
        [--only rope_attn] [--fused-new norm,router,attn,plan all] [--w-per-sm 1.05 2.1]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


# (passes, blocks per SM, floats per combine); the default (fused.ATT_*) is timed first, then these
SWEEP = [(4, 1.0, 32768), (4, 2.0, 65536), (4, 3.0, 98304), (4, 4.0, 131072), (4, 2.0, 131072),
         (2, 2.0, 65536), (4, 1.5, 65536)]


def measure(fn, replays: int) -> float:
    """us per replay of fn captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_us(graph, replays)


def replay_us(graph, replays: int, warm: int = 3) -> float:
    """us per replay of a captured CUDA graph: `warm` replays, then `replays` timed by CUDA events."""
    for _ in range(warm):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def _set_env(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pos", type=int, nargs="+", default=[0, 300, 1000, 3000, 8000], help="decode positions")
    p.add_argument("--layers", type=int, default=48, help="launches per graph, each on its own KV store (default 48)")
    p.add_argument("--heads", type=int, nargs=3, default=[32, 4, 128], metavar=("HQ", "HKV", "D"),
                   help="query heads, KV heads, head dim (default 32 4 128: Qwen3-30B-A3B)")
    p.add_argument("--ctx", type=int, default=8192, help="KV rows per layer (default 8192)")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed (default 50)")
    p.add_argument("--sweep", action="store_true", help="the fused kernels under other split plans too")
    p.add_argument("--only", nargs="+", help="variants timed (default: all of them)")
    p.add_argument("--fused-new", nargs="+", default=[None], help="HYBRID_FUSED_NEW values rope_attn is timed under")
    p.add_argument("--w-per-sm", type=float, nargs="+", default=[None],
                   help="fused.ATT_W_BLOCKS_PER_SM values rope_attn is timed under (fused_rope_attn_w's plan)")
    args = p.parse_args(argv)
    from hybrid.baselines.report import append_jsonl, stamp
    from hybrid.kernels import fused
    from hybrid.model.layers import Attention, Rotary, attn_keys, decode_mask

    hq, hkv, d = args.heads
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    n, cap = args.layers, args.ctx
    ks = [torch.randn(cap, hkv, d, generator=g, device=dev).half() for _ in range(n)]
    vs = [torch.randn(cap, hkv, d, generator=g, device=dev).half() for _ in range(n)]
    qs = [torch.randn(1, hq, d, generator=g, device=dev).half() for _ in range(n)]
    qkvs = [torch.randn(1, (hq + 2 * hkv) * d, generator=g, device=dev).half() for _ in range(n)]
    qn = 1 + 0.1 * torch.randn(d, generator=g, device=dev)
    kn = 1 + 0.1 * torch.randn(d, generator=g, device=dev)
    table = Rotary(d, 1e6).table(dev, cap)
    attn = Attention(None, None, None, None, hq, hkv, d, None, None, 1e-6)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    recs = []
    for pv in args.pos:
        keys = attn_keys(pv, cap)
        pos = torch.tensor([pv], device=dev)
        mask = decode_mask(pos, keys, torch.float16, dev)
        variants = {
            "sdpa": lambda i: attn._sdpa1(qs[i], ks[i][:keys], vs[i][:keys], mask),
            "decode_attn": lambda i: fused.decode_attn(qs[i], ks[i], vs[i], keys, pos=pos),
            "rope_attn": lambda i: fused.rope_attn(qkvs[i], qn, kn, table, ks[i], vs[i], hq, hkv, d, 1e-6, keys,
                                                   pos=pos),
            "qk_rope_kv+decode_attn": lambda i: fused.decode_attn(
                fused.qk_rope_kv(qkvs[i], qn, kn, table, ks[i], vs[i], hq, hkv, d, 1e-6, pos=pos), ks[i], vs[i],
                keys, pos=pos),
        }
        want = fused.ref_decode_attn(qs[0].float().cpu(), ks[0].float().cpu(), vs[0].float().cpu(), keys, start=pv)
        want_r = fused.ref_rope_attn(qkvs[0].cpu(), qn.cpu(), kn.cpu(), table.cpu(), ks[0].float().cpu(),
                                     vs[0].float().cpu(), hq, hkv, d, 1e-6, keys, start=pv)
        default = (fused.ATT_PASSES, fused.ATT_BLOCKS_PER_SM, fused.ATT_COMBINE_Q)
        knobs = [default] + (SWEEP if args.sweep else [])
        w_default, env0 = fused.ATT_W_BLOCKS_PER_SM, os.environ.get("HYBRID_FUSED_NEW")
        for name, call in variants.items():
            if args.only and name not in args.only:
                continue
            settings = ([(fn, w) for fn in args.fused_new for w in args.w_per_sm] if name == "rope_attn"
                        else [(None, None)])
            for fn, wps in settings:
                _set_env("HYBRID_FUSED_NEW", env0 if fn is None else fn)
                fused.ATT_W_BLOCKS_PER_SM = w_default if wps is None else wps
                kernel, per_sm = fused.rope_attn_kernel(hq, hkv, d) if name == "rope_attn" else (None, None)
                wide = kernel == "fused_rope_attn_w"
                for kn_ in knobs if name != "sdpa" else [default]:
                    fused.ATT_PASSES, fused.ATT_BLOCKS_PER_SM, fused.ATT_COMBINE_Q = kn_
                    us = measure(lambda: [call(i) for i in range(n)], args.replays) / n
                    plan = fused.attn_plan(keys, hkv, hq // hkv, d, sms, per_sm)
                    rec = {"variant": name, "pos": pv, "keys": keys, "us_per_launch": round(us, 2),
                           "heads": [hq, hkv, d], "plan": list(plan),
                           "knobs": {"passes": kn_[0], "blocks_per_sm": kn_[1], "combine_q": kn_[2]}, "sms": sms}
                    if name == "rope_attn":
                        rec.update(fused_new=os.environ.get("HYBRID_FUSED_NEW"), wide=wide,
                                   w_blocks_per_sm=fused.ATT_W_BLOCKS_PER_SM)
                        rec["max_abs_diff_vs_ref"] = float((call(0).float().cpu() - want_r.float()).abs().max())
                    if name in ("sdpa", "decode_attn"):
                        rec["max_abs_diff_vs_ref"] = float((call(0).float().cpu() - want).abs().max())
                    recs.append(rec)
                    print(json.dumps(rec), flush=True)
                fused.ATT_PASSES, fused.ATT_BLOCKS_PER_SM, fused.ATT_COMBINE_Q = default
            _set_env("HYBRID_FUSED_NEW", env0)
            fused.ATT_W_BLOCKS_PER_SM = w_default
    gpu = torch.cuda.get_device_name(0)
    recs = [{**r, **stamp("tools/gpu_attn_bench.py"), "gpu": gpu} for r in recs]
    for r in recs:
        if os.environ.get("HYBRID_GIT_SHA"):                 # the device copy has no .git
            r["git_sha"] = os.environ["HYBRID_GIT_SHA"]
    if os.environ.get("OUT"):
        append_jsonl(Path(os.environ["OUT"]) / "attn_bench.jsonl", recs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

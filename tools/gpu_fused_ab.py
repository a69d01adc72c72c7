"""A/B of the fused decode kernels (hybrid/kernels/fused.py) on a GPU, no checkpoint needed.

L Qwen3-30B-A3B-shaped dense layers (H 2048, 32/4 heads, D 128, 128 experts top-8; random NVFP4
q/k/v/o, fp32 router) run MoEModel.decode_dense for one token at a device position, with a stand-in
MoE output (x + h) between layers, captured as ONE CUDA graph, for each setting:
    torch  HYBRID_FUSED=0 (the torch ops)
    default  HYBRID_FUSED unset (hybrid.kernels.fused.DEFAULT_PARTS)
    fused-sdpa   HYBRID_FUSED=norm,rope,route (torch SDPA with its mask for the attention itself)
    fused-2attn  HYBRID_FUSED=norm,rope,attn,route (q/k norm + RoPE + KV write and attention as two kernels)
    fused  HYBRID_FUSED=1 (every part)
    fused+residual  HYBRID_FUSED=1 and the stand-in MoE output passed as decode_dense(residual=...)
                    (what hybrid/runtime/graphs.py would get by adding the MoE output in the next
                    layer's input RMSNorm)
    new, new+residual  fused / fused+residual with the newer kernels (HYBRID_FUSED_NEW=all:
                    fused_add_norm_router_e, fused_rope_attn_e)
(the other settings but default run with HYBRID_FUSED_NEW=0: the older kernels)
Per setting: GPU us per layer (CUDA events over graph replays), CUDA kernels per layer and the ten
kernels with the most device time per layer (torch.profiler over one eager run), eager host us per
layer, and the outputs against the torch setting. One JSON line
per setting on stdout (and appended to $OUT/fused_ab.jsonl when $OUT is set).

    PYTHONPATH=. python3 tools/gpu_fused_ab.py [--layers 48] [--pos 300 3000] [--replays 50] [--settings ...]
    python3 tools/gpu_fused_ab.py --device cpu --layers 2 --ctx 512   # a dry run of the script (CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from gpu_attn_bench import replay_us          # tools/ is on sys.path: this script's folder


SETTINGS = ("torch", "default", "fused-sdpa", "fused-2attn", "fused", "fused+residual", "new", "new+residual")


def build(layers: int, ctx: int, dev: torch.device):
    from hybrid.checkpoint.formats import QType, nvfp4_global_scale, quantize_nvfp4
    from hybrid.checkpoint.qweight import QWeight
    from hybrid.model.config import ModelConfig
    from hybrid.model.layers import Attention
    from hybrid.model.linear import Linear
    from hybrid.model.qwen_moe import DecoderLayer, MoEModel

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=1024, hidden_size=2048, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, max_position_embeddings=ctx)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    h, d = cfg.hidden_size, cfg.head_dim

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev) * scale

    def linears(shapes, name):
        ws = [rand(n, k, scale=k ** -0.5) for n, k in shapes]
        s2 = float(nvfp4_global_scale(max(w.abs().max() for w in ws)))   # shared: q/k/v fuse
        out = []
        for w, (n, k) in zip(ws, shapes):
            p, s, s2t = quantize_nvfp4(w, s2)
            out.append(Linear(QWeight(QType.NVFP4, (n, k), p, s, s2t.to(dev), name=name)))
        return out

    dec = []
    for _ in range(layers):
        q, k, v = linears([(32 * d, h), (4 * d, h), (4 * d, h)], "qkv")
        (o,) = linears([(h, 32 * d)], "o")
        attn = Attention(q, k, v, o, 32, 4, d, 1 + rand(d, scale=0.1), 1 + rand(d, scale=0.1), cfg.rms_norm_eps)
        dec.append(DecoderLayer(attn, 1 + rand(h, scale=0.1), 1 + rand(h, scale=0.1), rand(128, h, scale=h ** -0.5)))
    lm_head = Linear(QWeight(QType.F16, (1024, h), rand(1024, h).half(), name="lm_head"))
    m = MoEModel(cfg, torch.zeros(1024, h, dtype=dtype, device=dev), dec, torch.ones(h, device=dev),
                 lm_head, None, [dev] * layers, dtype)
    m.new_cache(ctx)
    m.prepare()
    return m


def body(m, x, pos, keys, residual: bool):
    mask = m.decode_mask(pos, keys)
    moe, ids = None, []
    for i in range(len(m.layers)):
        if residual:
            x, h, rid, _ = m.decode_dense(i, x, pos, keys, mask, residual=moe)
        else:
            x = x if moe is None else x + moe
            x, h, rid, _ = m.decode_dense(i, x, pos, keys, mask)
        moe = h                                             # stand-in for the layer's MoE output
        ids.append(rid)
    return x + moe, torch.cat(ids)


def measure(m, setting: str, pos_value: int, replays: int) -> dict:
    os.environ["HYBRID_FUSED"] = {"torch": "0", "default": "", "fused-sdpa": "norm,rope,route",
                                  "fused-2attn": "norm,rope,attn,route"}.get(setting, "1")
    if setting == "default":                                 # both switches as a user gets them
        os.environ.pop("HYBRID_FUSED_NEW", None)
    else:
        os.environ["HYBRID_FUSED_NEW"] = "all" if setting.startswith("new") else "0"
    residual = setting.endswith("+residual")
    dev = m.layer_devices[0]
    keys = min(-(-(pos_value + 1) // 256) * 256, m.cache.capacity)
    x_in = torch.randn(1, m.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dev, m.dtype)
    pos = torch.tensor([pos_value], device=dev)
    run = lambda: body(m, x_in, pos, keys, residual)  # noqa: E731
    rec = {"setting": setting, "layers": len(m.layers), "pos": pos_value, "keys": keys}
    if dev.type != "cuda":                                   # dry run: the eager body only
        out = run()
        return {**rec, "_out": (out[0].float(), out[1])}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / 3 * 1e6 / len(m.layers)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = len(kern)
    by_name: dict = {}
    try:
        for e in kern:                                     # device time per kernel name (CUPTI)
            t = by_name.setdefault(e.name[:60], [0.0, 0])
            t[0] += e.time_range.end - e.time_range.start
            t[1] += 1
    except AttributeError:                                 # a profiler without time ranges: counts only
        by_name = {}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:10]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    step_ms = replay_us(graph, replays, warm=1) / 1000
    return {**rec, "graph_us_per_layer": round(step_ms * 1000 / len(m.layers), 2), "graph_ms_per_step": round(step_ms, 3),
            "kernels_per_layer": round(kernels / len(m.layers), 2), "eager_host_us_per_layer": round(eager_us, 1),
            "top_kernels_us_per_layer": [[name, round(us / len(m.layers), 2), round(n / len(m.layers), 2)]
                                         for name, (us, n) in top],
            "_out": (out[0].float().cpu(), out[1].cpu())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48, help="decoder layers (default 48)")
    p.add_argument("--pos", type=int, nargs="+", default=[300], help="decode positions (default 300)")
    p.add_argument("--ctx", type=int, default=4096, help="KV rows (default 4096)")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed (default 50)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of this script)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                   help="settings measured, the first is the outputs' baseline (default: all)")
    args = p.parse_args(argv)
    from hybrid.baselines.report import append_jsonl, stamp

    m = build(args.layers, args.ctx, torch.device(args.device))
    recs = []
    for pos in args.pos:
        group = [measure(m, setting, pos, args.replays) for setting in args.settings]
        base_x, base_ids = group[0].pop("_out")
        for r in group[1:]:
            x, ids = r.pop("_out")
            r[f"max_abs_diff_x_vs_{args.settings[0]}"] = float((x - base_x).abs().max())
            r[f"ids_equal_vs_{args.settings[0]}"] = float((ids == base_ids).float().mean())
        recs += group
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    recs = [{**r, **stamp("tools/gpu_fused_ab.py"), "gpu": gpu} for r in recs]
    for r in recs:
        if os.environ.get("HYBRID_GIT_SHA"):                 # the device copy has no .git
            r["git_sha"] = os.environ["HYBRID_GIT_SHA"]
        print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        append_jsonl(Path(os.environ["OUT"]) / "fused_ab.jsonl", recs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

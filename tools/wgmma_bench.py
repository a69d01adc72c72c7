"""Time the sm_90a wgmma prefill GEMM (hybrid.kernels.sm90) against the current default prefill pick
(gemmf / WMMA, hybrid.kernels.qpn.prefill_plan) and cuBLAS FP16 on pre-dequantized weights, on an sm_90 GPU.

    PYTHONPATH=. python3 tools/wgmma_bench.py --out OUT.jsonl [--shapes lm_head,dense_up] [--m 64,128,512]

Each row: median of --reps launches (CUDA events, queued behind a GPU sleep, weight copies rotated
so nothing is served from L2: hybrid.bench.cuda_kernels.time_ms), the wgmma output's relative error
against an fp32 matmul of the dequantized weights, the plan labels; JSONL with machine and git sha.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import torch

SHAPES = {"lm_head": (151936, 2048), "dense_up": (25600, 5120), "dense_down": (5120, 25600),
          "q_proj": (4096, 2048), "o_proj": (2048, 4096), "expert_gate_up": (768, 2048)}


def git_sha() -> str:
    sha = os.environ.get("HYBRID_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def permute(sm90, x, m: int, k: int) -> None:
    """The pre-pass (qpn_sm90_permute_x) of a 256-token tiling, alone."""
    import ctypes

    mp, kp = -(-m // 256) * 256, -(-k // 64) * 64
    xp = torch.empty(mp, kp, dtype=torch.float16, device=x.device)
    sm90.launch(sm90.module(x.device), "qpn_sm90_permute_x", (-(-mp * kp // 16 // 256), 1, 1), 0,
                [sm90._p(x), sm90._p(xp), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(mp), ctypes.c_int(kp),
                 ctypes.c_int(256)])


def bench_shape(name: str, fmt: str, ms: list[int], reps: int, tiles: list) -> list[dict]:
    from hybrid.bench.cuda_kernels import _clone_weight, _gpu_dequant, copies_for, random_qweight, time_ms
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNWeight, qpn, qpn_linear, sm90

    n, k = SHAPES[name]
    dev = torch.device("cuda", torch.cuda.current_device())
    qtype = QType.NVFP4 if fmt == "nvfp4" else QType.FP8
    qw = random_qweight(qtype, n, k, dev)
    base = QPNWeight.from_qweight(qw, dev)
    ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
    wd = _gpu_dequant(qw).half()
    dense = [wd] + [wd.clone() for _ in range(copies_for(wd.numel() * 2) - 1)]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        ref = x.float() @ wd.float().t()
        qpn.PREFILL_VARIANT[0] = None
        default_sm90 = qpn.SM90_DEFAULT[0]
        qpn.SM90_DEFAULT[0] = False           # the gemmf / WMMA pick (the default before this GEMM)
        t_def = time_ms([lambda w=w: qpn_linear(x, w) for w in ws], reps)
        qpn.SM90_DEFAULT[0] = default_sm90
        pick = qpn.prefill_plan(2 if fmt == "nvfp4" else 8, m, n, k, sms, 90)
        t_cub = time_ms([lambda d=d: x @ d.t() for d in dense], reps)
        rec = dict(shape=name, n=n, k=k, format=fmt, m=m, default_us=t_def * 1e3,
                   default_kernel=pick.label if pick else "mt", cublas_us=t_cub * 1e3,
                   default_model_us=qpn.prefill_us(2 if fmt == "nvfp4" else 8, m, n, k, sms) if pick else None)
        for tag, tile, pipe, diag in tiles:
            if diag and fmt != "nvfp4":
                continue
            y = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
            sm90.linear(x, base, y, tile=tile, pipe=pipe, diag=diag)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            t = time_ms([lambda w=w: sm90.linear(x, w, torch.empty(m, n, dtype=torch.float16, device=dev), tile=tile,
                                                 pipe=pipe, diag=diag) for w in ws], reps)
            p = sm90.plan(2 if fmt == "nvfp4" else 8, m, n, k, sms, tile, pipe=pipe)
            blocks = p.grid[0] * p.grid[1] * p.grid[2]
            rec[f"wgmma_{tag}_plan"] = dict(tile=list(p.tile), pipe=p.pipe,
                                            splits=p.grid[2], ks=p.ks, mp=p.mp, kp=p.kp, blocks=blocks,
                                            waves=-(-blocks // (sms * sm90.resident(p.tile, "_w" if p.kernel.endswith("_w") else ""))),
                                            model_us=p.us)
            rec[f"wgmma_{tag}_us"] = t * 1e3
            rec[f"wgmma_{tag}_kernel"] = p.label
            rec[f"wgmma_{tag}_relerr"] = err
        rec["permute_us"] = time_ms([lambda: permute(sm90, x, m, k)], reps) * 1e3   # the pre-pass alone
        out.append(rec)
        line = (f"{name:14s} {fmt:5s} M={m:4d} cuBLAS {rec['cublas_us']:8.1f}  default {rec['default_us']:8.1f} "
                f"({rec['default_kernel']})")
        for tag, _, _, diag in tiles:
            if f"wgmma_{tag}_us" not in rec:
                continue
            line += (f"  wgmma[{tag}] {rec[f'wgmma_{tag}_us']:8.1f} ({rec[f'wgmma_{tag}_kernel']}, "
                     f"err {rec[f'wgmma_{tag}_relerr']:.1e})")
        print(line + f"  permute {rec['permute_us']:.1f}", flush=True)
    del ws, wd, dense
    torch.cuda.empty_cache()
    return out


def parse_tile(v: str):
    """'pick' -> (tag, None, None, ''); '<BR>x<NT>[_s][_nold]' -> (tag, (BR, NT), pipe, diag)."""
    if v == "pick":
        return v, None, None, ""
    diag = "_nold" if v.endswith("_nold") else ""
    base, _, sfx = v[: len(v) - len(diag)].partition("_")
    return v, tuple(int(a) for a in base.split("x")), "_" + sfx if sfx else "", diag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="append JSONL records here")
    ap.add_argument("--shapes", default="lm_head,dense_up,dense_down,q_proj", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--m", default="64,128,512")
    ap.add_argument("--tiles", default="pick", help="comma list of wgmma kernels to time: pick, <BR>x<NT>[_s][_nold] "
                                                    "(hybrid.kernels.sm90.TILES; _s: the per-step pipeline; "
                                                    "_nold: NVFP4 timing-only diagnostic without main-loop loads)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("tools/wgmma_bench.py: needs an sm_90 GPU")
        return 2
    tiles = [parse_tile(v) for v in args.tiles.split(",")]
    env = dict(machine=platform.node(), gpu=torch.cuda.get_device_name(), git_sha=git_sha(),
               torch=torch.__version__,
               command="tools/wgmma_bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    with open(args.out, "a") as f:
        for name in args.shapes.split(","):
            if name not in SHAPES:
                print(f"--shapes: unknown shape {name!r} (expected {', '.join(SHAPES)})")
                return 2
            for fmt in args.formats.split(","):
                for rec in bench_shape(name, fmt, [int(v) for v in args.m.split(",")], args.reps, tiles):
                    f.write(json.dumps({**env, **rec}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

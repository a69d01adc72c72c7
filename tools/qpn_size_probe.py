"""Probe (issue 5): the M <= 8 QPN kernels' time against the bytes they read, beside a plain read of
the same bytes, to split lm_head's gap to the read bandwidth into a steady rate and a fixed cost.

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_size_probe.py --out $OUT/size.jsonl

K = 2048 (lm_head's) and N = lm_head's 151936 rows times each of --scales. Per N: NVFP4 at M = 1 and 8 and
FP8 at M = 1 through qpn_linear (the launcher's pick), torch's fp32 sum over a buffer of the NVFP4 weight's
bytes (the kind of reduction that measures the read bandwidth) and qpn_read over it (a kernel that only
reads), and cuBLAS FP16 (x @ W^T on a dense fp16
weight) at M = 1 where N is at most lm_head's. Timed as hybrid-bench cuda-kernels does (CUDA events,
median, copies rotated past the L2). Then a least-squares fit t = a + bytes / B per series: B is the
steady rate, a the fixed cost of a launch (ramp, tail, the gap between kernels). Rows: series, n, bytes,
t_us, eff_read; fit rows: series, a_us, b_gbs, b_over_read.
--ncu: one lm_head launch each of NVFP4 M = 1 and M = 8, nothing timed (run it under ncu).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
import torch

from hybrid.bench.cuda_kernels import _clone_weight, bandwidths, copies_for, random_qweight, time_ms
from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNWeight, qpn, qpn_linear

LM_N, K = 151936, 2048


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t_us = a + bytes / B -> (a us, B GB/s)."""
    slope, a = np.polyfit([b for b, _ in points], [t for _, t in points], 1)    # us per byte, us
    return float(a), 1e-3 / float(slope)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="size.jsonl")
    ap.add_argument("--scales", default="0.25,0.5,1,2,4")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sha", default="unknown")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--m1-variants", default="",
                    help="comma list of LINEAR_VARIANT choices also timed at NVFP4 M = 1 (e.g. _m1,_m1x2)")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    if a.ncu:
        w = QPNWeight.from_qweight(random_qweight(QType.NVFP4, LM_N, K, dev), dev)
        for m in (1, 8):
            qpn_linear(torch.randn(m, K, device=dev, dtype=torch.float16), w)
        torch.cuda.synchronize()
        return 0
    read_bw, copy_bw = bandwidths()
    head = {"what": "qpn_size_probe", "git_sha": a.sha, "gpu": torch.cuda.get_device_name(dev),
            "command": " ".join(["tools/qpn_size_probe.py", *sys.argv[1:]]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
            "read_gbs": round(read_bw, 1), "copy_gbs": round(copy_bw, 1)}
    print(json.dumps(head), flush=True)
    out = open(a.out, "a")
    out.write(json.dumps(head) + "\n")
    series: dict[str, list[tuple[float, float]]] = {}

    def row(name: str, n: int, nbytes: int, t_ms: float) -> None:
        r = {"series": name, "n": n, "bytes": nbytes, "t_us": round(t_ms * 1e3, 2),
             "eff_read": round(nbytes / (t_ms * 1e-3) / 1e9 / read_bw, 4)}
        series.setdefault(name, []).append((nbytes, t_ms * 1e3))
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")

    for sc in (float(s) for s in a.scales.split(",")):
        n = max(16, round(LM_N * sc / 16) * 16)
        for qt, ms in ((QType.NVFP4, (1, 8)), (QType.FP8, (1,))):
            base = QPNWeight.from_qweight(random_qweight(qt, n, K, dev), dev)
            ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
            for m in ms:
                x = torch.randn(m, K, device=dev, dtype=torch.float16)
                extra = a.m1_variants.split(",") if qt is QType.NVFP4 and m == 1 and a.m1_variants else []
                for v in (None, *extra):                  # the default kernel, then each forced variant
                    qpn.LINEAR_VARIANT[0] = v
                    try:
                        t = time_ms([lambda w=w: qpn_linear(x, w) for w in ws], a.reps)
                    finally:
                        qpn.LINEAR_VARIANT[0] = None
                    row(f"{qt.name.lower()}_m{m}{v or ''}", n, base.nbytes, t)
            if qt is QType.NVFP4:
                nb = base.nbytes
            del ws, base
            torch.cuda.empty_cache()
        bufs = [torch.rand(nb // 4, device=dev) for _ in range(copies_for(nb))]
        t = time_ms([lambda b=b: b.sum() for b in bufs], a.reps)
        row("sum_fp32", n, nb // 4 * 4, t)
        t = time_ms([lambda b=b: qpn.read_bytes(b) for b in bufs], a.reps)
        row("qpn_read", n, nb // 4 * 4, t)
        del bufs
        if sc <= 1:
            wd = [torch.randn(n, K, device=dev, dtype=torch.float16) for _ in range(copies_for(n * K * 2))]
            x = torch.randn(1, K, device=dev, dtype=torch.float16)
            t = time_ms([lambda w=w: x @ w.t() for w in wd], a.reps)
            row("cublas_fp16_m1", n, n * K * 2, t)
            del wd
        torch.cuda.empty_cache()
    for name, pts in series.items():
        if len(pts) >= 2:
            a_us, b = fit(pts)
            r = {"series": name, "fit": True, "a_us": round(a_us, 2), "b_gbs": round(b, 1),
                 "b_over_read": round(b / read_bw, 4)}
            print(json.dumps(r), flush=True)
            out.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

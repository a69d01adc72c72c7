"""A/B (issue 5): the NVFP4 M = 1 kernels with a staggered first wave (HYBRID_QPN_STAGGER=1, qpn.stagger_grid)
against the plain launch, on hybrid-bench cuda-kernels' shapes, rounds alternating in one process.

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/qpn_stagger_ab.py --out $OUT/stagger.jsonl

Per shape: the launcher's kernel at M = 1 timed as hybrid-bench cuda-kernels times it (CUDA events, median of
--reps, copies rotated past the L2) with the switch off and on, --rounds times; the two outputs compared (the K
split differs, so the fp32 sums' order does too). Rows: one per (shape, mode, round); a summary per shape
(median us per mode, on / off).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch

from hybrid.bench.cuda_kernels import SHAPES, _clone_weight, bandwidths, copies_for, random_qweight, time_ms
from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNWeight, qpn, qpn_linear


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="stagger.jsonl")
    ap.add_argument("--shapes", default="lm_head,dense_up,dense_down,q_proj,o_proj,k_proj,expert_gate_up,expert_down")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sha", default="unknown")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    read_bw, copy_bw = bandwidths()
    out = open(a.out, "a")

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")

    emit({"what": "qpn_stagger_ab", "git_sha": a.sha, "gpu": torch.cuda.get_device_name(dev),
          "command": " ".join(["tools/qpn_stagger_ab.py", *sys.argv[1:]]),
          "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
          "read_gbs": round(read_bw, 1), "copy_gbs": round(copy_bw, 1)})
    dims = {name: (n, k) for name, n, k in SHAPES}
    for shape in a.shapes.split(","):
        n, k = dims[shape]
        base = QPNWeight.from_qweight(random_qweight(QType.NVFP4, n, k, dev), dev)
        ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        ys, times = {}, {"0": [], "1": []}
        for rnd in range(a.rounds):
            for mode in ("0", "1"):
                os.environ[qpn.STAGGER_ENV] = mode
                ys[mode] = qpn_linear(x, base).float()
                t = time_ms([lambda w=w: qpn_linear(x, w) for w in ws], a.reps) * 1e3
                times[mode].append(t)
                emit({"shape": shape, "n": n, "k": k, "stagger": mode, "round": rnd, "t_us": round(t, 2),
                      "eff_read": round(base.nbytes / (t * 1e3) / read_bw, 4)})
        os.environ.pop(qpn.STAGGER_ENV)
        off, on = statistics.median(times["0"]), statistics.median(times["1"])
        rel = ((ys["1"] - ys["0"]).norm() / ys["0"].norm()).item()
        emit({"summary": True, "shape": shape, "off_us": round(off, 2), "on_us": round(on, 2),
              "on_over_off": round(on / off, 4), "eff_read_off": round(base.nbytes / (off * 1e3) / read_bw, 4),
              "eff_read_on": round(base.nbytes / (on * 1e3) / read_bw, 4), "y_rel_diff": rel})
        del ws, base
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

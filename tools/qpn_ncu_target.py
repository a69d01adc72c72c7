"""The launches an ncu profile of the QPN M <= 8 linear kernels is taken over: one shape's weight (and copies past the
L2), --launches at each M in turn, nothing else on the GPU.

    ncu --clock-control none --kernel-name regex:qpn2_linear --launch-skip 4 --launch-count 8 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 tools/qpn_ncu_target.py --shape lm_head --m 1,8 --launches 6

(results/cuda_kernels_probes.jsonl, `ncu_qpn2_linear`: the twenty-ninth session ran this as a scratch script.)"""
from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lm_head", help="a shape of hybrid.bench.cuda_kernels.SHAPES")
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "fp8"))
    ap.add_argument("--m", default="1,8", help="comma list of activation rows, in launch order")
    ap.add_argument("--launches", type=int, default=6, help="launches per M")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("qpn_ncu_target: no CUDA device", file=sys.stderr)
        return 2
    from hybrid.bench.cuda_kernels import SHAPES, _clone_weight, random_qweight
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNWeight, qpn_linear

    dims = {s: (n, k) for s, n, k in SHAPES}
    if a.shape not in dims:
        print(f"qpn_ncu_target: --shape {a.shape!r}: expected one of {', '.join(dims)}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    n, k = dims[a.shape]
    base = QPNWeight.from_qweight(random_qweight(QType(a.format), n, k, dev), dev)
    ws = [base] + [_clone_weight(base) for _ in range(3)]
    for m in (int(v) for v in a.m.split(",")):
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        for i in range(a.launches):
            qpn_linear(x, ws[i % len(ws)])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

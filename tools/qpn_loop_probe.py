"""Probe: the QPN linear kernel of one shape looped at each M in turn, nothing else on the GPU: with --seconds, NVML's
SM clock sampled meanwhile (the clock under sustained load); with --launches, a fixed number of launches (the target
an ncu profile is taken over).

    python3 tools/qpn_loop_probe.py --shape lm_head --format nvfp4 --m 1,8,1,8 --seconds 1.5 --out clock.jsonl
    ncu --clock-control none --kernel-name regex:qpn2_linear --launch-skip 4 --launch-count 8 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 tools/qpn_loop_probe.py --shape lm_head --m 1,8 --launches 6

The weight and its copies rotate past the L2 (hybrid.bench.cuda_kernels.copies_for, as hybrid-bench cuda-kernels
times them). Clock rows: what, launches,
samples, min / median / max MHz, power at the end (W); after the M loops a GPU spin (torch.cuda._sleep) as a light
load. NVML's clock is a sample of the card's state, not the clock a given kernel ran at (results/cuda_kernels.md,
twenty-ninth session: ncu measured 1.79-1.80 GHz where NVML read 1980 afterwards). The twenty-ninth session's
`sm_clock_under_load` and `ncu_qpn2_linear` records came from scratch versions of this."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="lm_head", help="a shape of hybrid.bench.cuda_kernels.SHAPES")
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "fp8"))
    ap.add_argument("--m", default="1,8", help="comma list of activation rows, looped in this order")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--seconds", type=float, default=None, help="loop time per M, the SM clock sampled (default 1.5)")
    how.add_argument("--launches", type=int, default=None, help="launches per M, no sampling (an ncu target)")
    ap.add_argument("--poll-ms", type=float, default=5.0, help="with --seconds: NVML sampling period")
    ap.add_argument("--out", default="", help="with --seconds: also append the rows to this JSONL file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("qpn_loop_probe: no CUDA device", file=sys.stderr)
        return 2
    from hybrid.bench.cuda_kernels import SHAPES, _clone_weight, copies_for, random_qweight
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNWeight, qpn_linear

    dims = {s: (n, k) for s, n, k in SHAPES}
    if a.shape not in dims:
        print(f"qpn_loop_probe: --shape {a.shape!r}: expected one of {', '.join(dims)}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    n, k = dims[a.shape]
    base = QPNWeight.from_qweight(random_qweight(QType(a.format), n, k, dev), dev)
    ws = [base] + [_clone_weight(base) for _ in range(copies_for(base.nbytes) - 1)]
    ms = [int(v) for v in a.m.split(",")]
    if a.launches is not None:
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            for i in range(a.launches):
                qpn_linear(x, ws[i % len(ws)])
        torch.cuda.synchronize()
        return 0
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index)
    seconds = 1.5 if a.seconds is None else a.seconds
    out = open(a.out, "a") if a.out else None

    def sample(fn) -> dict:
        got, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                got.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
                time.sleep(a.poll_ms / 1e3)

        fn()
        torch.cuda.synchronize()
        th = threading.Thread(target=poll)
        t0, launches = time.time(), 0
        th.start()
        while time.time() - t0 < seconds:
            for _ in range(50):
                fn()
                launches += 1
            torch.cuda.synchronize()
        stop.set()
        th.join()
        return {"launches": launches, "samples": len(got), "min": min(got), "median": statistics.median(got),
                "max": max(got), "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000}

    def emit(row: dict) -> None:
        row = {"gpu": torch.cuda.get_device_name(dev), "driver": pynvml.nvmlSystemGetDriverVersion(), **row}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        i = [0]

        def step():
            qpn_linear(x, ws[i[0] % len(ws)])
            i[0] += 1

        emit({"what": f"{a.shape} {a.format} M={m}", **sample(step)})
    emit({"what": "torch.cuda._sleep(200000)", **sample(lambda: torch.cuda._sleep(200000))})
    return 0


if __name__ == "__main__":
    sys.exit(main())

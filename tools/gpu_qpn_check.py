"""The one script a device call runs for the QPN kernels: build, check, time.

    PYTHONPATH=. HYBRID_CACHE_DIR=.qpncache python3 tools/gpu_qpn_check.py --out $OUT --git-sha SHA

1. build: NVRTC compiles the native module (timed); compute_70 PTX comes prebuilt from
   `hybrid-bench cuda-kernels --compile-only --arch sm_70 --emit .qpncache` (CUDA 13 NVRTC cannot
   target sm_70) and is JIT-compiled by the driver in the tests;
2. check: pytest tests/test_qpn_cuda.py (native build and compute_70 PTX, all M, MoE, rejects);
3. time: hybrid-bench cuda-kernels -> OUT/cuda_kernels.{md,jsonl}.
Every stage writes its log under --out; a failing stage does not stop the next.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def stage(name: str, cmd: list[str], log: Path, timeout: int) -> int:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                f.write(line)
                print(line, end="", flush=True)
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 124
    print(f"== {name}: rc={rc} in {time.time() - t0:.1f} s", flush=True)
    return rc


def build_info() -> str:
    import torch

    from hybrid.kernels.build import module
    from hybrid.kernels.nvrtc import load_nvrtc

    t0 = time.time()
    mod = module(torch.device("cuda", 0))
    nv = load_nvrtc()
    return (f"{torch.cuda.get_device_name(0)} sm_{mod.sm}; torch {torch.__version__}; "
            f"NVRTC {nv.version} at {nv.path}; native build {time.time() - t0:.1f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results")))
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--bench-args", default="", help="extra arguments for hybrid-bench cuda-kernels")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--test-k", default="", help="pytest -k expression (a subset of the GPU tests)")
    ap.add_argument("--test-timeout", type=int, default=200)
    ap.add_argument("--bench-timeout", type=int, default=260)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = build_info()
    print(info, flush=True)
    (args.out / "build.txt").write_text(info + "\n")
    rc_t = 0
    if not args.skip_tests:
        rc_t = stage("tests", [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "tests/test_qpn_cuda.py", *(["-k", args.test_k] if args.test_k else [])],
                     args.out / "tests.log", args.test_timeout)
    command = f"python3 tools/gpu_qpn_check.py {' '.join(argv or sys.argv[1:])}"
    rc_b = stage("bench", [sys.executable, "-m", "hybrid.cli.bench", "cuda-kernels", "--out",
                           str(args.out / "cuda_kernels"), "--git-sha", args.git_sha,
                           "--command", command, *args.bench_args.split()],
                 args.out / "bench.log", args.bench_timeout)
    print(f"tests rc={rc_t} bench rc={rc_b}")
    return rc_t or rc_b


if __name__ == "__main__":
    sys.exit(main())

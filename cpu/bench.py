"""Benchmark hook for hybrid-bench calibrate: GB/s of packed NVFP4 expert bytes at M = 1.

Measured the way `hybrid-bench cpu-kernels` does (hybrid/bench/cpu_kernels.py): Qwen3-30B-A3B
expert shapes, top-8 experts per call, a set of experts twice the last-level cache.
"""
from __future__ import annotations


def nvfp4_expert_gbs(threads: int | None = None, M: int = 1) -> float:
    from hybrid.bench.cpu_kernels import SHAPES, build_store, expert_count, ours_gbs
    from hybrid.checkpoint.formats import QType
    from hybrid.experts.cpu_runner import CpuExpertRunner

    H, I = SHAPES["qwen3-30b-a3b"]
    store = build_store(H, I, QType.NVFP4, expert_count(H, I, QType.NVFP4, quick=True))
    try:
        with CpuExpertRunner(store, threads=threads) as runner:
            return max(ours_gbs(store, runner, M, reps=3) for _ in range(2))
    finally:
        store.close()

"""Probes of what this machine gives the expert kernels: read-only bandwidth, and compute scaling.

    total = read_parallel(a, unit, n)    # a u8 [N] (N % 8 == 0), n parts -> sum of a's int64 words
    compute_parallel(w, G, xq, xs, rows, acc, calls, n)   # n parts, each GEMVs on its own weight

`n` parts on Numba's thread pool (one `prange` over the parts, as cpu/expert.py's
`experts_parallel`) claim `unit`-byte spans of `a` one at a time from a shared counter
(cpu/atomic.py) and sum them as int64 words (vectorized integer adds: the core does nothing but
load).  Bytes / time of one call is the read ceiling our kernels stream against: STREAM copy
(hybrid-bench cpu-kernels' `copy`) counts read + write bytes, and a write stream costs a
read-for-ownership plus a write-back, so copy's figure is not what a read-only kernel can reach.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from cpu.atomic import counters, fetch_add
from cpu.i16 import nvfp4_i16_tile

UNIT = 147456        # bytes per claimed span: one phase-1 unit of the Qwen3 expert (gate + up tile)


@njit(nogil=True, fastmath=True, cache=True)
def _sum_words(w, i0, i1):
    """Σ w[i0:i1] (u64 words, wrapping): 4 ymm `vpaddq` with a memory operand per 128 B.  The
    loop runs over a slice from 0: indexing w[i] with i from range(i0, i1) keeps Numba's
    negative-index wraparound, and LLVM then loads word by word (~25% slower, measured)."""
    v = w[i0:i1]
    s = np.uint64(0)
    for i in range(v.shape[0]):
        s += v[i]
    return s


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def read_parallel(a, unit, n):
    """a u8 [N] (N % 8 == 0); unit bytes per span (multiple of 8); n parts -> Σ of a's u64 words."""
    w = a.view(np.uint64)
    uw = unit // 8
    nu = (w.shape[0] + uw - 1) // uw
    nxt = counters(1)
    total = np.uint64(0)
    for k in prange(n):
        s = np.uint64(0)
        u = fetch_add(nxt, 0, 1)
        while u < nu:
            s += _sum_words(w, u * uw, min(w.shape[0], (u + 1) * uw))
            u = fetch_add(nxt, 0, 1)
        total += s
    return total


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def compute_parallel(w, G, xq, xs, rows, acc, calls, n):
    """n parts on Numba's pool; part k runs `calls` int16 GEMVs (M = 1, cpu/i16.py) over its own
    cache-resident weight w[k] (u8 [n, NT, tile bytes]) into acc[k] (f32 [n, 1, R]): no memory
    stream, no barrier, no Python between calls.  Time at n parts over time at 1 part, times n,
    is what n threads of this machine give to independent kernel compute (ideal n; less where
    vCPUs share physical cores or clocks drop with more cores busy)."""
    for k in prange(n):
        for c in range(calls):
            for t in range(w.shape[1]):
                nvfp4_i16_tile(w[k, t], G, xq, xs, rows, 0, 1, acc[k])

"""Fused SwiGLU experts over an arena of prepacked weights: out += w * down(silu(gate x) * up x).

One expert slot in the arena (byte offsets from cpu/layout.py, R rows per tile):
    gate_up: NTI tile pairs [gate tile t | up tile t]      (weights [I, H], K = H)
    down:    NTH tiles                                      (weight  [H, I], K = I)
The two phases are separate calls so that threads can split rows with a barrier between them:
    phase 1 `experts_gate_up`: work units (expert e, I-tile t), e-major, any split is race-free
    phase 2 `experts_down`:    H-tiles [t0, t1) of every listed expert (a thread owns its columns)

Legend: T tokens, H hidden, I intermediate (Ipad = NTI * R), E listed experts,
P = Σ_e rows of expert e (token rows concatenated: rows[ptr[e]:ptr[e+1]]).
Inputs:  qkind NVFP4_F32=0 | FP8=1 | NVFP4_I16=2 (NVFP4 = the host's family, cpu/isa.py; the arena
         must be packed for it: cpu/layout.py), arena u8 [*], gu_off/dn_off i64 [E] byte offsets,
         scl f32 [E, 3] global scales (gate, up, down), x f32 [T, H], rows i64 [P],
         ptr i64 [E + 1], w f32 [P] routing weights; h f32 [P, Ipad] scratch; out f32 [T, H].
NVFP4_I16 (cpu/i16.py): x is quantized to int16 per 16-block once per call (xq i16 [T, H],
xs f32 [T, H/16]), phase 1 quantizes its SiLU output straight into hq i16 [P, Ipad] / hs f32
[P, Ipad/16], which phase 2 reads.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from cpu.atomic import counters, fetch_add
from cpu.gemm import FP8_FACTOR, MB, NVFP4_FACTOR, scratch
from cpu.i16 import I16_FACTOR, NO_LIMIT, PREFETCH, nvfp4_i16_tile, nvfp4_i16_tile_pf, quantize_row, quantize_rows
from cpu.isa import NVFP4_INT16
from cpu.layout import GROUP
from cpu.tiles import JIT, fp8_tile, nvfp4_tile

NVFP4_F32, FP8, NVFP4_I16 = 0, 1, 2
NVFP4 = NVFP4_I16 if NVFP4_INT16 else NVFP4_F32      # the family layout.pack_nvfp4 packs for here
QUANT_PARALLEL_ROWS = 64                            # x quantized on the pool from this many rows


@njit(**JIT)
def tile_nbytes(qkind, k, R):
    """Bytes of one R-row tile of a weight with k in-features."""
    return k * R if qkind == FP8 else (k // GROUP) * 9 * R


@njit(**JIT)
def _tile(qkind, arena, base, k, x, rows, p0, p1, acc, dec):
    R = acc.shape[1]
    if qkind != FP8:
        g = k // GROUP
        nvfp4_tile(arena[base: base + g * 9 * R].reshape((g, 9, R)), x, rows, p0, p1, acc, dec)
    else:
        fp8_tile(arena[base: base + k * R].reshape((k, R)), x, rows, p0, p1, acc, dec)


@njit(**JIT)
def experts_gate_up(qkind, arena, gu_off, scl, x, rows, ptr, u0, u1, h, H, I, R):
    """Phase 1, units [u0, u1): h[p, t*R:(t+1)*R] = silu(gate) * up for the expert's rows p."""
    nti = (I + R - 1) // R
    tb = tile_nbytes(qkind, H, R)
    fac = FP8_FACTOR if qkind == FP8 else NVFP4_FACTOR
    acc_g, dec = scratch(R)
    acc_u = np.empty_like(acc_g)
    for u in range(u0, u1):
        e, t = u // nti, u % nti
        base = gu_off[e] + 2 * t * tb
        cg, cu = scl[e, 0] * fac, scl[e, 1] * fac
        for b0 in range(ptr[e], ptr[e + 1], MB):
            b1 = min(ptr[e + 1], b0 + MB)
            _tile(qkind, arena, base, H, x, rows, b0, b1, acc_g, dec)              # [m, R]
            _tile(qkind, arena, base + tb, H, x, rows, b0, b1, acc_u, dec)         # [m, R]
            for m in range(b1 - b0):
                for r in range(R):
                    g = acc_g[m, r] * cg
                    h[b0 + m, t * R + r] = g / (np.float32(1.0) + math.exp(-g)) * (acc_u[m, r] * cu)


@njit(**JIT)
def experts_down(qkind, arena, dn_off, scl, h, rows, ptr, w, t0, t1, out, H, I, R):
    """Phase 2, H-tiles [t0, t1): out[rows[p], cols] += w[p] * down(h[p]) for every listed expert."""
    tb = tile_nbytes(qkind, I, R)
    fac = FP8_FACTOR if qkind == FP8 else NVFP4_FACTOR
    hrows = np.arange(h.shape[0])
    acc, dec = scratch(R)
    for t in range(t0, t1):
        n0 = t * R
        nr = min(R, H - n0)
        for e in range(len(ptr) - 1):
            cd = scl[e, 2] * fac
            for b0 in range(ptr[e], ptr[e + 1], MB):
                b1 = min(ptr[e + 1], b0 + MB)
                _tile(qkind, arena, dn_off[e] + t * tb, I, h, hrows, b0, b1, acc, dec)
                for m in range(b1 - b0):
                    tok, wm = rows[b0 + m], w[b0 + m] * cd
                    for r in range(nr):
                        out[tok, n0 + r] += wm * acc[m, r]


# ----------------------------------------------------------------------------- NVFP4 x int16
@njit(**JIT)
def experts_gate_up_i16(arena, gu_off, scl, xq, xs, rows, ptr, u0, u1, hq, hs, H, I, R):
    """Phase 1 (NVFP4_I16), units [u0, u1): hq/hs[p, tile t] = int16(silu(gate) * up), per 16-block."""
    for u in range(u0, u1):
        gate_up_unit_i16(arena, gu_off, scl, xq, xs, rows, ptr, u, hq, hs, H, I, R, PREFETCH, NO_LIMIT, 0)


@njit(**JIT)
def gate_up_unit_i16(arena, gu_off, scl, xq, xs, rows, ptr, u, hq, hs, H, I, R, pf, pf_end, pf_jump):
    """Unit u = (expert e, I-tile t) of phase 1 (NVFP4_I16); prefetches pf bytes ahead, moved by
    pf_jump where that reaches pf_end bytes from the unit's start (nvfp4_i16_tile_pf; the unit's
    gate|up tile pair is 2 tb bytes)."""
    nti = (I + R - 1) // R
    tb = tile_nbytes(NVFP4_I16, H, R)
    G = H // GROUP
    acc_g = np.empty((MB, R), np.float32)
    acc_u = np.empty_like(acc_g)
    hrow = np.empty(R, np.float32)
    e, t = u // nti, u % nti
    base = gu_off[e] + 2 * t * tb
    cg, cu = scl[e, 0] * I16_FACTOR, scl[e, 1] * I16_FACTOR
    for b0 in range(ptr[e], ptr[e + 1], MB):
        b1 = min(ptr[e + 1], b0 + MB)
        nvfp4_i16_tile_pf(arena[base: base + tb], G, xq, xs, rows, b0, b1, acc_g, pf, pf_end, pf_jump)    # [m, R]
        nvfp4_i16_tile_pf(arena[base + tb: base + 2 * tb], G, xq, xs, rows, b0, b1, acc_u, pf,
                          pf_end - tb, pf_jump)                                                        # [m, R]
        for m in range(b1 - b0):
            for r in range(R):
                g = acc_g[m, r] * cg
                hrow[r] = g / (np.float32(1.0) + math.exp(-g)) * (acc_u[m, r] * cu)
            quantize_row(hrow, hq[b0 + m, t * R: (t + 1) * R],
                         hs[b0 + m, t * R // GROUP: (t + 1) * R // GROUP])


@njit(**JIT)
def experts_down_i16(arena, dn_off, scl, hq, hs, rows, ptr, w, t0, t1, out, H, I, R):
    """Phase 2 (NVFP4_I16), H-tiles [t0, t1): out[rows[p], cols] += w[p] * down(hq/hs[p])."""
    tb = tile_nbytes(NVFP4_I16, I, R)
    G = I // GROUP
    hrows = np.arange(hq.shape[0])
    acc = np.empty((MB, R), np.float32)
    for t in range(t0, t1):
        n0 = t * R
        nr = min(R, H - n0)
        for e in range(len(ptr) - 1):
            cd = scl[e, 2] * I16_FACTOR
            base = dn_off[e] + t * tb
            for b0 in range(ptr[e], ptr[e + 1], MB):
                b1 = min(ptr[e + 1], b0 + MB)
                nvfp4_i16_tile(arena[base: base + tb], G, hq, hs, hrows, b0, b1, acc)
                for m in range(b1 - b0):
                    tok, wm = rows[b0 + m], w[b0 + m] * cd
                    for r in range(nr):
                        out[tok, n0 + r] += wm * acc[m, r]


@njit(**JIT)
def i16_buffers(x, P, I, R):
    """xq i16 [T, H], xs f32 [T, H/16], hq i16 [P, Ipad], hs f32 [P, Ipad/16] (x not yet quantized)."""
    T, H = x.shape
    ipad = (I + R - 1) // R * R
    return (np.empty((T, H), np.int16), np.empty((T, H // GROUP), np.float32),
            np.empty((P, ipad), np.int16), np.empty((P, ipad // GROUP), np.float32))


# ----------------------------------------------------------------------------- entry points
@njit(**JIT)
def experts_forward(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R):
    """Both phases on the calling thread: out[T, H] += Σ_e w * expert_e(x[rows_e])."""
    nti = (I + R - 1) // R
    nth = (H + R - 1) // R
    n1 = (len(ptr) - 1) * nti
    if qkind == NVFP4_I16:
        xq, xs, hq, hs = i16_buffers(x, rows.shape[0], I, R)
        quantize_rows(x, 0, x.shape[0], xq, xs)
        experts_gate_up_i16(arena, gu_off, scl, xq, xs, rows, ptr, 0, n1, hq, hs, H, I, R)
        experts_down_i16(arena, dn_off, scl, hq, hs, rows, ptr, w, 0, nth, out, H, I, R)
        return
    h = np.empty((rows.shape[0], nti * R), np.float32)
    experts_gate_up(qkind, arena, gu_off, scl, x, rows, ptr, 0, n1, h, H, I, R)
    experts_down(qkind, arena, dn_off, scl, h, rows, ptr, w, 0, nth, out, H, I, R)


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def experts_parallel(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, n):
    """experts_forward on Numba's thread pool, n parts per phase.  The parts claim units one at a
    time from a shared counter (cpu/atomic.py): phase 1 units are (expert, I-tile) pairs, phase 2
    units H-tiles, so a part that is slow or descheduled holds back at most the unit it is on (a
    fixed split waits for the slowest part at each phase's barrier).  One call from Python (no
    per-worker dispatch under the GIL); every output element is computed by one unit in a fixed
    order, so the result does not depend on n nor on which part took which unit."""
    nti = (I + R - 1) // R
    nth = (H + R - 1) // R
    n1 = (len(ptr) - 1) * nti
    nxt = counters(2)                                  # next unclaimed unit of phase 1, phase 2
    if qkind == NVFP4_I16:
        T = x.shape[0]
        xq, xs, hq, hs = i16_buffers(x, rows.shape[0], I, R)
        if T >= QUANT_PARALLEL_ROWS:
            for k in prange(n):
                quantize_rows(x, T * k // n, T * (k + 1) // n, xq, xs)
        else:
            quantize_rows(x, 0, T, xq, xs)
        for k in prange(n):
            u = fetch_add(nxt, 0, 1)
            while u < n1:
                experts_gate_up_i16(arena, gu_off, scl, xq, xs, rows, ptr, u, u + 1, hq, hs, H, I, R)
                u = fetch_add(nxt, 0, 1)
        for k in prange(n):
            t = fetch_add(nxt, 1, 1)
            while t < nth:
                experts_down_i16(arena, dn_off, scl, hq, hs, rows, ptr, w, t, t + 1, out, H, I, R)
                t = fetch_add(nxt, 1, 1)
        return
    h = np.empty((rows.shape[0], nti * R), np.float32)
    for k in prange(n):
        u = fetch_add(nxt, 0, 1)
        while u < n1:
            experts_gate_up(qkind, arena, gu_off, scl, x, rows, ptr, u, u + 1, h, H, I, R)
            u = fetch_add(nxt, 0, 1)
    for k in prange(n):
        t = fetch_add(nxt, 1, 1)
        while t < nth:
            experts_down(qkind, arena, dn_off, scl, h, rows, ptr, w, t, t + 1, out, H, I, R)
            t = fetch_add(nxt, 1, 1)

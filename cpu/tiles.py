"""Tile kernels: one R-row weight tile times a block of activation rows, fp32 accumulate.

Legend: G groups of 16 along K, R rows per tile, MB activation rows per block.
Activation row m of a block is `x[rows[p0 + m]]`: token rows are gathered inside the loops,
never copied.  Results are unscaled: the caller multiplies by the weight's global scale times
E2M1_FACTOR * E4M3_FACTOR (NVFP4) or E4M3_FACTOR (FP8).

Which loop runs for a block of M rows (`nvfp4_tile` / `fp8_tile`):
    M >= 12   decode a [16, R] slice once into `dec`, then one FMA pass per row (`*_mn`);
              FP8 at every M (FP8_MN_MIN: faster than its fused loops at M = 1..8)
    else      fused decode+FMA over 8 (NVFP4), 4, 2, then 1 rows at a time (`*_m8`, `*_m4`, `*_m2`,
              `*_m1`, in cpu/tiles_unrolled.py): each byte decoded once per 8 (4) rows, group sums
              in registers.
Every inner loop runs over the R rows of the tile (contiguous), which LLVM vectorizes.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.decode import e4m3, nib_hi, nib_lo
from cpu.tiles_unrolled import (fp8_tile_m1, fp8_tile_m2, fp8_tile_m4, nvfp4_tile_m1, nvfp4_tile_m2,
                                nvfp4_tile_m4, nvfp4_tile_m8)

JIT = dict(nogil=True, fastmath=True, cache=True)
MN_MIN = 12  # from this many rows on, the decode-once buffer path is faster (NVFP4)
FP8_MN_MIN = 1  # FP8: decode-once at every M (L2-resident GEMV, cycles per 128 B, fused -> decode-once:
                # M=1 52.8 -> 47.1, M=2 71.0 -> 60.2, M=4 124.2 -> 88.3, M=8 242.0 -> 143.7..226.9)


# ----------------------------------------------------------------------------- NVFP4
@njit(**JIT)
def nvfp4_tile(tile, x, rows, p0, p1, acc, dec):
    """tile u8 [G, 9, R]; x f32 [*, K]; acc f32 [MB, R] -> acc[m] for m < p1 - p0; dec f32 [16, R] scratch."""
    m = p1 - p0
    if m >= MN_MIN:
        nvfp4_tile_mn(tile, x, rows, p0, p1, acc, dec)
        return
    i = 0
    while m - i >= 8:
        nvfp4_tile_m8(tile, x, rows, p0 + i, acc[i:])
        i += 8
    if m - i >= 4:
        nvfp4_tile_m4(tile, x, rows, p0 + i, acc[i:])
        i += 4
    if m - i >= 2:
        nvfp4_tile_m2(tile, x, rows, p0 + i, acc[i:])
        i += 2
    if m - i == 1:
        nvfp4_tile_m1(tile, x, rows, p0 + i, acc[i:])


@njit(**JIT)
def nvfp4_tile_mn(tile, x, rows, p0, p1, acc, dec):
    """Many rows: decode [16, R] per group into dec (scale folded), then one FMA pass per row."""
    G, _, R = tile.shape
    acc[: p1 - p0] = 0
    for g in range(G):
        for j in range(8):
            for r in range(R):                                              # [R] SIMD
                b = tile[g, j, r]
                s = e4m3(tile[g, 8, r])
                dec[2 * j, r] = nib_lo(b) * s
                dec[2 * j + 1, r] = nib_hi(b) * s
        _dot16(dec, x, rows, p0, p1, g * 16, acc)


# ----------------------------------------------------------------------------- FP8
@njit(**JIT)
def fp8_tile(tile, x, rows, p0, p1, acc, dec):
    """tile u8 [K, R] e4m3 bits; acc f32 [MB, R] -> acc[m] for m < p1 - p0; dec f32 [16, R] scratch."""
    m = p1 - p0
    if m >= FP8_MN_MIN:
        fp8_tile_mn(tile, x, rows, p0, p1, acc, dec)
        return
    i = 0
    while m - i >= 4:
        fp8_tile_m4(tile, x, rows, p0 + i, acc[i:])
        i += 4
    if m - i >= 2:
        fp8_tile_m2(tile, x, rows, p0 + i, acc[i:])
        i += 2
    if m - i == 1:
        fp8_tile_m1(tile, x, rows, p0 + i, acc[i:])


@njit(**JIT)
def fp8_tile_mn(tile, x, rows, p0, p1, acc, dec):
    K, R = tile.shape
    acc[: p1 - p0] = 0
    for c in range(0, K, 16):
        for j in range(16):
            for r in range(R):                                              # [R] SIMD
                dec[j, r] = e4m3(tile[c + j, r])
        _dot16(dec, x, rows, p0, p1, c, acc)


# ----------------------------------------------------------------------------- shared
@njit(**JIT)
def _dot16(dec, x, rows, p0, p1, c, acc):
    """acc[m, r] += Σ_{j<16} dec[j, r] * x[rows[p0 + m], c + j]."""
    R = dec.shape[1]
    for m in range(p1 - p0):
        xr = x[rows[p0 + m], c: c + 16]
        x0, x1, x2, x3 = xr[0], xr[1], xr[2], xr[3]
        x4, x5, x6, x7 = xr[4], xr[5], xr[6], xr[7]
        x8, x9, x10, x11 = xr[8], xr[9], xr[10], xr[11]
        x12, x13, x14, x15 = xr[12], xr[13], xr[14], xr[15]
        for r in range(R):                                                  # [R] SIMD
            acc[m, r] += ((dec[0, r] * x0 + dec[1, r] * x1) + (dec[2, r] * x2 + dec[3, r] * x3)
                          + (dec[4, r] * x4 + dec[5, r] * x5) + (dec[6, r] * x6 + dec[7, r] * x7)) \
                + ((dec[8, r] * x8 + dec[9, r] * x9) + (dec[10, r] * x10 + dec[11, r] * x11)
                   + (dec[12, r] * x12 + dec[13, r] * x13) + (dec[14, r] * x14 + dec[15, r] * x15))

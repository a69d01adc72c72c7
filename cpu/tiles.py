"""Tile kernels: one R-row weight tile times a block of activation rows, fp32 accumulate.

Legend: G groups of 16 along K, R rows per tile, MB activation rows per block.
Activation row m of a block is `x[rows[p0 + m]]`: token rows are gathered inside the loops,
never copied.  Results are unscaled: the caller multiplies by the weight's global scale times
E2M1_FACTOR * E4M3_FACTOR (NVFP4) or E4M3_FACTOR (FP8).

Which loop runs for a block of M rows (`nvfp4_tile` / `fp8_tile`):
    M >= 12   decode a [16, R] slice once into `dec`, then one FMA pass per row (`*_mn`)
    else      fused decode+FMA over 4, 2, then 1 rows at a time (`*_m4`, `*_m2`, `*_m1`):
              each packed byte is decoded once per 4 rows, all in registers.
Every inner loop runs over the R rows of the tile (contiguous), which LLVM vectorizes.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.decode import e4m3, nib_hi, nib_lo

JIT = dict(nogil=True, fastmath=True, cache=True)
MN_MIN = 12  # from this many rows on, the decode-once buffer path is faster


# ----------------------------------------------------------------------------- NVFP4
@njit(**JIT)
def nvfp4_tile(tile, x, rows, p0, p1, acc, accg, dec):
    """tile u8 [G, 9, R]; x f32 [*, K]; acc f32 [MB, R] -> acc[m] for m < p1 - p0.

    accg f32 [4, R] and dec f32 [16, R] are scratch.
    """
    m = p1 - p0
    if m >= MN_MIN:
        nvfp4_tile_mn(tile, x, rows, p0, p1, acc, dec)
        return
    i = 0
    while m - i >= 4:
        nvfp4_tile_m4(tile, x, rows, p0 + i, acc[i:], accg)
        i += 4
    if m - i >= 2:
        nvfp4_tile_m2(tile, x, rows, p0 + i, acc[i:], accg)
        i += 2
    if m - i == 1:
        nvfp4_tile_m1(tile, x, rows, p0 + i, acc[i:], accg)


@njit(**JIT)
def nvfp4_tile_m1(tile, x, rows, p0, acc, accg):
    """One row: acc[0, r] = Σ_k w[r, k] x[rows[p0], k] (unscaled)."""
    G, _, R = tile.shape
    a = rows[p0]
    acc[0] = 0
    for g in range(G):
        accg[0] = 0
        for j in range(0, 8, 2):
            c = g * 16 + 2 * j
            x0, x1, x2, x3 = x[a, c], x[a, c + 1], x[a, c + 2], x[a, c + 3]
            for r in range(R):                                              # [R] SIMD
                b, d = tile[g, j, r], tile[g, j + 1, r]
                accg[0, r] += (nib_lo(b) * x0 + nib_hi(b) * x1) + (nib_lo(d) * x2 + nib_hi(d) * x3)
        for r in range(R):
            acc[0, r] += accg[0, r] * e4m3(tile[g, 8, r])


@njit(**JIT)
def nvfp4_tile_m2(tile, x, rows, p0, acc, accg):
    """Two rows, each byte decoded once."""
    G, _, R = tile.shape
    a, e = rows[p0], rows[p0 + 1]
    acc[:2] = 0
    for g in range(G):
        accg[:2] = 0
        for j in range(0, 8, 2):
            c = g * 16 + 2 * j
            x0, x1, x2, x3 = x[a, c], x[a, c + 1], x[a, c + 2], x[a, c + 3]
            y0, y1, y2, y3 = x[e, c], x[e, c + 1], x[e, c + 2], x[e, c + 3]
            for r in range(R):                                              # [R] SIMD
                b, d = tile[g, j, r], tile[g, j + 1, r]
                w0, w1, w2, w3 = nib_lo(b), nib_hi(b), nib_lo(d), nib_hi(d)
                accg[0, r] += (w0 * x0 + w1 * x1) + (w2 * x2 + w3 * x3)
                accg[1, r] += (w0 * y0 + w1 * y1) + (w2 * y2 + w3 * y3)
        for r in range(R):
            s = e4m3(tile[g, 8, r])
            acc[0, r] += accg[0, r] * s
            acc[1, r] += accg[1, r] * s


@njit(**JIT)
def nvfp4_tile_m4(tile, x, rows, p0, acc, accg):
    """Four rows, each byte decoded once."""
    G, _, R = tile.shape
    a0, a1, a2, a3 = rows[p0], rows[p0 + 1], rows[p0 + 2], rows[p0 + 3]
    acc[:4] = 0
    for g in range(G):
        accg[:4] = 0
        for j in range(0, 8, 2):
            c = g * 16 + 2 * j
            x00, x01, x02, x03 = x[a0, c], x[a0, c + 1], x[a0, c + 2], x[a0, c + 3]
            x10, x11, x12, x13 = x[a1, c], x[a1, c + 1], x[a1, c + 2], x[a1, c + 3]
            x20, x21, x22, x23 = x[a2, c], x[a2, c + 1], x[a2, c + 2], x[a2, c + 3]
            x30, x31, x32, x33 = x[a3, c], x[a3, c + 1], x[a3, c + 2], x[a3, c + 3]
            for r in range(R):                                              # [R] SIMD
                b, d = tile[g, j, r], tile[g, j + 1, r]
                w0, w1, w2, w3 = nib_lo(b), nib_hi(b), nib_lo(d), nib_hi(d)
                accg[0, r] += (w0 * x00 + w1 * x01) + (w2 * x02 + w3 * x03)
                accg[1, r] += (w0 * x10 + w1 * x11) + (w2 * x12 + w3 * x13)
                accg[2, r] += (w0 * x20 + w1 * x21) + (w2 * x22 + w3 * x23)
                accg[3, r] += (w0 * x30 + w1 * x31) + (w2 * x32 + w3 * x33)
        for r in range(R):
            s = e4m3(tile[g, 8, r])
            acc[0, r] += accg[0, r] * s
            acc[1, r] += accg[1, r] * s
            acc[2, r] += accg[2, r] * s
            acc[3, r] += accg[3, r] * s


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
def fp8_tile(tile, x, rows, p0, p1, acc, accg, dec):
    """tile u8 [K, R] e4m3 bits; acc f32 [MB, R] -> acc[m] for m < p1 - p0 (accg unused)."""
    m = p1 - p0
    if m >= MN_MIN:
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
def fp8_tile_m1(tile, x, rows, p0, acc):
    K, R = tile.shape
    a = rows[p0]
    acc[0] = 0
    for k in range(0, K, 4):
        x0, x1, x2, x3 = x[a, k], x[a, k + 1], x[a, k + 2], x[a, k + 3]
        for r in range(R):                                                  # [R] SIMD
            acc[0, r] += (e4m3(tile[k, r]) * x0 + e4m3(tile[k + 1, r]) * x1) + \
                         (e4m3(tile[k + 2, r]) * x2 + e4m3(tile[k + 3, r]) * x3)


@njit(**JIT)
def fp8_tile_m2(tile, x, rows, p0, acc):
    K, R = tile.shape
    a, e = rows[p0], rows[p0 + 1]
    acc[:2] = 0
    for k in range(0, K, 2):
        x0, x1, y0, y1 = x[a, k], x[a, k + 1], x[e, k], x[e, k + 1]
        for r in range(R):                                                  # [R] SIMD
            w0, w1 = e4m3(tile[k, r]), e4m3(tile[k + 1, r])
            acc[0, r] += w0 * x0 + w1 * x1
            acc[1, r] += w0 * y0 + w1 * y1


@njit(**JIT)
def fp8_tile_m4(tile, x, rows, p0, acc):
    K, R = tile.shape
    a0, a1, a2, a3 = rows[p0], rows[p0 + 1], rows[p0 + 2], rows[p0 + 3]
    acc[:4] = 0
    for k in range(0, K, 2):
        x00, x01, x10, x11 = x[a0, k], x[a0, k + 1], x[a1, k], x[a1, k + 1]
        x20, x21, x30, x31 = x[a2, k], x[a2, k + 1], x[a3, k], x[a3, k + 1]
        for r in range(R):                                                  # [R] SIMD
            w0, w1 = e4m3(tile[k, r]), e4m3(tile[k + 1, r])
            acc[0, r] += w0 * x00 + w1 * x01
            acc[1, r] += w0 * x10 + w1 * x11
            acc[2, r] += w0 * x20 + w1 * x21
            acc[3, r] += w0 * x30 + w1 * x31


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

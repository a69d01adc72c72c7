"""Weight-only GEMV / small-M GEMM over prepacked tiles (cpu/layout.py): y = x @ W.T * scale.

Legend: M activation rows, K in, N out, R rows per tile, MB rows per block.
Each call computes tiles [t0, t1) (rows t0*R .. t1*R of W), so threads can split rows.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.decode import E2M1_FACTOR, E4M3_FACTOR
from cpu.i16 import I16_FACTOR, nvfp4_i16_tile, quantize_rows
from cpu.tiles import JIT, fp8_tile, nvfp4_tile

MB = 32  # activation rows per block
NVFP4_FACTOR = np.float32(E2M1_FACTOR * E4M3_FACTOR)
FP8_FACTOR = np.float32(E4M3_FACTOR)


@njit(**JIT)
def nvfp4_gemm(tiles, x, scale_2, y, t0, t1):
    """tiles u8 [NT, G, 9, R], x f32 [M, K], scale_2 f32 -> y f32 [M, N] rows t0*R..t1*R."""
    R = tiles.shape[3]
    M = x.shape[0]
    rows = np.arange(M)
    acc, dec = scratch(R)
    c = np.float32(scale_2) * NVFP4_FACTOR
    for t in range(t0, t1):
        for b0 in range(0, M, MB):
            b1 = min(M, b0 + MB)
            nvfp4_tile(tiles[t], x, rows, b0, b1, acc, dec)
            _store(acc, b0, b1, t * R, c, y)


@njit(**JIT)
def nvfp4_i16_gemm(tiles, x, scale_2, y, t0, t1):
    """tiles u8 [NT, R/8, G*72] (int16 layout), x f32 [M, K], scale_2 f32 -> y f32 [M, N] rows
    t0*R..t1*R; x is quantized per 16-block to int16 first (cpu/i16.py)."""
    R = 8 * tiles.shape[1]
    M, K = x.shape
    G = K // 16
    xq = np.empty((M, K), np.int16)
    xs = np.empty((M, G), np.float32)
    quantize_rows(x, 0, M, xq, xs)
    rows = np.arange(M)
    acc = np.empty((MB, R), np.float32)
    c = np.float32(scale_2) * I16_FACTOR
    for t in range(t0, t1):
        for b0 in range(0, M, MB):
            b1 = min(M, b0 + MB)
            nvfp4_i16_tile(tiles[t].reshape(-1), G, xq, xs, rows, b0, b1, acc)
            _store(acc, b0, b1, t * R, c, y)


@njit(**JIT)
def fp8_gemm(tiles, x, scale, y, t0, t1):
    """tiles u8 [NT, K, R], x f32 [M, K], scale f32 -> y f32 [M, N] rows t0*R..t1*R."""
    R = tiles.shape[2]
    M = x.shape[0]
    rows = np.arange(M)
    acc, dec = scratch(R)
    c = np.float32(scale) * FP8_FACTOR
    for t in range(t0, t1):
        for b0 in range(0, M, MB):
            b1 = min(M, b0 + MB)
            fp8_tile(tiles[t], x, rows, b0, b1, acc, dec)
            _store(acc, b0, b1, t * R, c, y)


@njit(**JIT)
def scratch(R):
    """acc f32 [MB, R], dec f32 [16, R]."""
    return np.empty((MB, R), np.float32), np.empty((16, R), np.float32)


@njit(**JIT)
def _store(acc, b0, b1, n0, c, y):
    n1 = min(y.shape[1], n0 + acc.shape[1])
    for m in range(b1 - b0):
        for r in range(n1 - n0):
            y[b0 + m, n0 + r] = acc[m, r] * c

"""Kernel layouts of one linear weight [N, K], prepacked once at load (cpu/ kernels read only these).

Rows are cut into tiles of R = 64 output features (the last tile zero-padded); each tile is one
contiguous run of bytes, so a worker that owns a range of tiles streams memory linearly.

NVFP4 tile  u8 [G, 9, R]   (G = K / 16 groups)
    [g, j, r]  j < 8: elements 16g+2j (lo) and 16g+2j+1 (hi) of row r, re-coded as
               bit 7 sign_hi | bit 6 sign_lo | bits 5..3 mag_hi | bits 2..0 mag_lo
               (ModelOpt: low nibble = element 2j, bit 3 of a nibble = sign)
    [g, 8, r]  the row's e4m3 block scale of group g
    value = E2M1 * e4m3(scale) * weight_scale_2        (weight_scale_2 kept outside, fp32)
NVFP4 int16 tile  u8 [R/8, G*72]  (the int16-activation kernels, cpu/i16.py; same bytes per tile)
    8-row block b holds its whole K, so one block streams linearly:
    [b, 64g + 32h + 4i + c]  h < 2, i < 8, c < 4: ModelOpt byte 8g + 4h + c of row 8b + i, unchanged
                             (low nibble element 16g + 8h + 2c, high nibble the next one)
    [b, 64G + 8g + i]        row 8b + i's e4m3 block scale of group g
FP8 tile    u8 [K, R]      [k, r] = e4m3 bits of W[r, k]; value = e4m3 * weight_scale

Legend: N out features, K in features, R rows per tile, NT = ceil(N / R) tiles.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.isa import NVFP4_INT16

R = 64        # output rows per tile
GROUP = 16    # NVFP4 elements per block scale


def num_tiles(n: int) -> int:
    return -(-n // R)


def nvfp4_nbytes(n: int, k: int) -> int:
    """Bytes of the NVFP4 tile layout of an [n, k] weight (padding included)."""
    _check_k(k)
    return num_tiles(n) * (k // GROUP) * 9 * R


def fp8_nbytes(n: int, k: int) -> int:
    _check_k(k)
    return num_tiles(n) * k * R


def _check_k(k: int) -> None:
    if k % GROUP:
        raise ValueError(f"in-features {k} must be a multiple of {GROUP}")


def _recode_table() -> np.ndarray:
    """ModelOpt byte (lo nibble | hi nibble << 4) -> kernel byte (see module docstring)."""
    b = np.arange(256, dtype=np.uint16)
    lo, hi = b & 0xF, b >> 4
    out = ((hi & 8) << 4) | ((lo & 8) << 3) | ((hi & 7) << 3) | (lo & 7)
    return out.astype(np.uint8)


RECODE = _recode_table()


def pack_nvfp4(data: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None,
               int16: bool = NVFP4_INT16) -> np.ndarray:
    """ModelOpt data u8 [N, K/2] + scale bits u8 [N, K/16] -> tiles u8 [NT, G, 9, R], or with
    `int16` (default where cpu/isa.py picks the int16 kernels: AVX2) the int16-kernel tiles
    u8 [NT, R/8, G*72].

    Writes into `out` (any contiguous u8 buffer of nvfp4_nbytes) when given: no second copy.
    One compiled pass (GIL released), so the expert store fills on several threads.
    """
    n, half_k = data.shape
    k = half_k * 2
    nt, g = num_tiles(n), k // GROUP
    if scale.shape != (n, g):
        raise ValueError(f"NVFP4 scale shape {scale.shape} != {(n, g)}")
    data, scale = np.ascontiguousarray(data), np.ascontiguousarray(scale)
    if int16:
        tiles = _out(out, (nt, R // 8, g * 72), nvfp4_nbytes(n, k))
        _pack_nvfp4_i16(data, scale, tiles)
    else:
        tiles = _out(out, (nt, g, 9, R), nvfp4_nbytes(n, k))
        _pack_nvfp4(data, scale, RECODE, tiles)
    return tiles


def pack_fp8(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """e4m3 bits u8 [N, K] -> tiles u8 [NT, K, R]."""
    n, k = data.shape
    tiles = _out(out, (num_tiles(n), k, R), fp8_nbytes(n, k))
    _pack_fp8(np.ascontiguousarray(data), tiles)
    return tiles


@njit(nogil=True, cache=True)
def _pack_nvfp4(data, scale, recode, tiles):  # [N, G*8], [N, G], [256], [NT, G, 9, R]
    n = data.shape[0]
    for t in range(tiles.shape[0]):
        for r in range(R):
            row = t * R + r
            if row < n:
                for gi in range(tiles.shape[1]):
                    for j in range(8):
                        tiles[t, gi, j, r] = recode[data[row, 8 * gi + j]]
                    tiles[t, gi, 8, r] = scale[row, gi]
            else:
                for gi in range(tiles.shape[1]):
                    for j in range(9):
                        tiles[t, gi, j, r] = 0


@njit(nogil=True, cache=True)
def _pack_nvfp4_i16(data, scale, tiles):  # [N, G*8], [N, G], [NT, R/8, G*72]
    n, g = scale.shape
    for t in range(tiles.shape[0]):
        for b in range(R // 8):
            blk = tiles[t, b]
            for i in range(8):
                row = t * R + 8 * b + i
                for gi in range(g):
                    for h in range(2):
                        for c in range(4):
                            blk[64 * gi + 32 * h + 4 * i + c] = data[row, 8 * gi + 4 * h + c] if row < n else 0
                    blk[64 * g + 8 * gi + i] = scale[row, gi] if row < n else 0


@njit(nogil=True, cache=True)
def _pack_fp8(data, tiles):  # [N, K], [NT, K, R]
    n = data.shape[0]
    for t in range(tiles.shape[0]):
        for r in range(R):
            row = t * R + r
            for kk in range(tiles.shape[1]):
                tiles[t, kk, r] = data[row, kk] if row < n else 0


def _out(out, shape, nbytes):
    if out is None:
        return np.empty(shape, dtype=np.uint8)
    if out.dtype != np.uint8 or out.size != nbytes or not out.flags.c_contiguous:
        raise ValueError(f"output buffer must be contiguous u8 of {nbytes} bytes, "
                         f"got {out.dtype} {out.size}")
    return out.reshape(shape)

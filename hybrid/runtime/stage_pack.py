"""Pack a group of experts' stored bytes into QPN slot storage on the device, in a few launches.

Legend: G experts of the group, I expert intermediate, H hidden, N = G*2I (gate|up rows) or G*H
(down rows), K in-features, Tn = N/16 tiles, C chunks per tile row (K/64 NVFP4, K/32 FP8).

A prefill step streams every expert it misses (hybrid.runtime.prefill_stream): each is uploaded
as stored (NVFP4: nibbles u8 [rows, K/2] + e4m3 group scales u8 [rows, K/16]; FP8: e4m3 bytes
[rows, K]) and must land in the slot layout the grouped kernel reads (hybrid.kernels.layout).
layout.pack_nvfp4 does one weight at a time in int64 (~70 launches, ~150 bytes of traffic per
element): fine for a promotion, not for 128 experts per layer. Here the group's gate|up rows are
stacked (the slot's w13 is gate tiles then up tiles, and I, H are multiples of 16, so no tile
straddles two experts or two weights) and packed at once: each QPN2 word takes its eight nibbles
from four bytes, one 256-entry table per (half, byte) position built from layout.FP4_BITS, so a
word is four table lookups or'ed together (under 10 bytes of traffic per element). Bit for bit what
layout.pack_nvfp4 gives (tests/test_prefill_stream.py). FP8 is a byte shuffle: layout.pack_fp8.
"""
from __future__ import annotations

import torch

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.kernels import layout

_LUTS: dict = {}


def fp4_luts(device: torch.device) -> torch.Tensor:
    """int32 [4, 256]: row 2*half + b maps a stored byte (nibbles kk = 2b low, 2b+1 high, sign
    already folded) to its bits in the QPN2 word (layout.FP4_BITS)."""
    device = torch.device(device)
    lut = _LUTS.get(device)
    if lut is None:
        v = torch.arange(256, dtype=torch.int64)
        rows = []
        for half in (0, 1):
            for b in (0, 1):
                word = torch.zeros(256, dtype=torch.int64)
                for kk, e in ((2 * b, v & 15), (2 * b + 1, v >> 4)):
                    ms, ss = layout.FP4_BITS[(half, kk)]
                    word |= ((e & 7) << ms) | ((e >> 3) << ss)
                rows.append(word)
        lut = torch.stack(rows)
        lut = torch.where(lut >= 2 ** 31, lut - 2 ** 32, lut).to(torch.int32).to(device)
        _LUTS[device] = lut
    return lut


def pack_nvfp4_rows(data: torch.Tensor, scale: torch.Tensor, words: torch.Tensor,
                    scales: torch.Tensor) -> None:
    """data u8 [N, K/2], scale u8 [N, K/16] (e4m3 bits) -> words int32 [Tn, C, 32, 4] and scales
    u8 [Tn, C, 8, 8] (written in place; any contiguous tensors of those sizes). N % 16 == 0."""
    n, k = data.shape[0], data.shape[1] * 2
    if n % layout.TILE or k % 64:
        raise ValueError(f"pack_nvfp4_rows: rows {n} must be a multiple of 16, in-features {k} of 64")
    tn, c = n // layout.TILE, k // 64
    perm = (0, 3, 2, 5, 4, 1, 6)                                          # -> t c r q j half b
    flip = ((scale.view(tn, 2, 8, c, 4, 1, 1) >> 7) * 0x88).permute(*perm)  # fold the scale's sign
    b = data.view(tn, 2, 8, c, 4, 4, 2).permute(*perm)                    # t c r q j half b (a view)
    out = words.view(tn, c, 8, 4, 4)                                      # t c r q j
    lut = fp4_luts(data.device)
    for i, (half, bb) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        idx = b[..., half, bb].to(torch.int32, memory_format=torch.contiguous_format)   # [Tn, C, 8, 4, 4]
        idx ^= flip[..., half, 0]
        part = lut[i].index_select(0, idx.view(-1)).view(tn, c, 8, 4, 4)
        if i == 0:
            out.copy_(part)
        else:
            out.bitwise_or_(part)
        del idx, part                        # transients: two int32 copies of a quarter of the bytes
    sc = (scale & 0x7F).view(tn, 2, 8, c, 2, 2)                           # t half r c w jj
    scales.view(tn, c, 8, 8).copy_(sc.permute(0, 3, 2, 4, 1, 5).reshape(tn, c, 8, 8))


def pack_fp8_rows(data: torch.Tensor, words: torch.Tensor) -> None:
    """data u8 [N, K] (e4m3 bits) -> words int32 [Tn, C, 32, 4], in place."""
    n, k = data.shape
    qw = QWeight(QType.FP8, (n, k), data.view(torch.float8_e4m3fn))
    words.view(-1).copy_(layout.pack_fp8(qw).view(-1))


def pack_group(slots, g: int, raw: dict, first: int = 0) -> None:
    """Slots first..first+g-1 of QPNExpertSlots `slots` from the group's stored bytes on its device:
    raw = {'d13': u8 [G, 2I, H/2 or H], 'd2': u8 [G, H, I/2 or I], 'gs': f32 [G, 3]} (+ 's13' u8
    [G, 2I, H/16], 's2' u8 [G, H, I/16] for NVFP4); rows of gate then up, as the slot holds them."""
    h, i, end = slots.hidden, slots.inter, first + g
    if slots.qtype is QType.NVFP4:
        pack_nvfp4_rows(raw["d13"][:g].reshape(g * 2 * i, h // 2), raw["s13"][:g].reshape(g * 2 * i, h // 16),
                        slots.w13[first:end], slots.s13[first:end])
        pack_nvfp4_rows(raw["d2"][:g].reshape(g * h, i // 2), raw["s2"][:g].reshape(g * h, i // 16),
                        slots.w2[first:end], slots.s2[first:end])
    else:
        pack_fp8_rows(raw["d13"][:g].reshape(g * 2 * i, h), slots.w13[first:end])
        pack_fp8_rows(raw["d2"][:g].reshape(g * h, i), slots.w2[first:end])
    finish_group(slots, first, raw["gs"][:g])


def finish_group(slots, first: int, gs: torch.Tensor) -> None:
    """A packed group's folded global scales gs [g, 3] into slots first..first+g-1, which are then
    marked loaded (a host gs is copied up without waiting: staged by the driver at once)."""
    slots.gs[first:first + gs.shape[0]].copy_(gs, non_blocking=True)
    for j in range(first, first + gs.shape[0]):
        slots.host[j] = True

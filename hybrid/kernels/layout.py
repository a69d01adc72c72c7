"""QPN prepacked layouts (see the header of cuda/qpn.cu), built once at load with torch ops.

Legend: N out rows, K in, Np = N rounded up to 16, Tn = Np/16 tiles, C chunks per tile row
(K/64 for QPN2, K/32 for QPN8), G = K/16 groups. Lane l of a warp owns rows r = l//4, r+8 of
a tile and the k-slice q = l%4 (elements 16g + 4q + 0..3) of every group g.

QPN2 (NVFP4):  words  int32 [Tn, C, 32, 4]   scales uint8 [Tn, C, 8, 8]
QPN8 (FP8):    words  int32 [Tn, C, 32, 4]   (no group scales; per-tensor fp32)

`decode_*` emulate the kernel's register decode bit for bit (tests compare them with
hybrid.checkpoint.formats' reference dequantization).
"""
from __future__ import annotations

import torch

from hybrid.checkpoint.formats import GROUP, QType, unpack_nibbles
from hybrid.checkpoint.qweight import QWeight

TILE = 16
CHUNK = {QType.NVFP4: 64, QType.FP8: 32}
FOLD = {QType.NVFP4: 2.0 ** 7, QType.FP8: 2.0 ** 8}  # undoes the register decode's 2^-7 / 2^-8

# NVFP4 word: (half, kk) -> (magnitude shift, sign shift); half 0 = row r, 1 = row r+8
FP4_BITS = {(0, 0): (9, 15), (0, 1): (25, 31), (1, 0): (6, 12), (1, 1): (22, 28),
            (0, 2): (0, 13), (0, 3): (16, 29), (1, 2): (3, 14), (1, 3): (19, 30)}
FP8_BYTE_ORDER = (0, 2, 1, 3)  # byte b of a QPN8 word holds element kk = FP8_BYTE_ORDER[b]


def check_shape(qtype: QType, n: int, k: int, where: str = "weight") -> None:
    """Raise ValueError for shapes the kernels cannot take."""
    if qtype not in CHUNK:
        raise ValueError(f"{where}: QPN kernels take NVFP4 or FP8 weights, got {qtype.value}")
    if n < 1 or k < 1 or k % CHUNK[qtype]:
        raise ValueError(f"{where}: {qtype.value} in-features must be a positive multiple of "
                         f"{CHUNK[qtype]} for the QPN kernels, got shape ({n}, {k})")


def _to_i32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 bit patterns -> int32 with the same bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def _pad_rows(t: torch.Tensor, np_: int) -> torch.Tensor:
    if t.shape[0] == np_:
        return t
    pad = torch.zeros((np_ - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def pack_nvfp4(qw: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 QWeight -> (words int32 [Tn, C, 32, 4], scales uint8 [Tn, C, 8, 8]), on qw's device."""
    n, k = qw.shape
    check_shape(QType.NVFP4, n, k, qw.name or "weight")
    np_, c = -(-n // TILE) * TILE, k // 64
    data = qw.data
    codes = unpack_nibbles(data).to(torch.int64)                          # [N, K]
    sb = qw.scale.view(torch.uint8).to(torch.int64)                       # [N, G]
    neg = (sb >= 0x80).repeat_interleave(GROUP, dim=1)                    # [N, K]
    codes = torch.where(neg, codes ^ 8, codes)                            # fold the scale's sign
    sb = sb & 0x7F
    codes = _pad_rows(codes, np_).view(np_ // TILE, 2, 8, c, 4, 4, 4)    # t half r c j q kk
    codes = codes.permute(0, 3, 2, 5, 4, 1, 6)                            # t c r q j half kk
    word = torch.zeros(codes.shape[:5], dtype=torch.int64, device=data.device)
    for (half, kk), (ms, ss) in FP4_BITS.items():
        e = codes[..., half, kk]
        word |= ((e & 7) << ms) | ((e >> 3) << ss)
    words = _to_i32(word.reshape(np_ // TILE, c, 32, 4)).contiguous()
    sc = _pad_rows(sb, np_).view(np_ // TILE, 2, 8, c, 2, 2)              # t half r c w jj
    scales = sc.permute(0, 3, 2, 4, 1, 5).reshape(np_ // TILE, c, 8, 8).to(torch.uint8).contiguous()
    return words, scales


def pack_fp8(qw: QWeight) -> torch.Tensor:
    """FP8 QWeight -> words int32 [Tn, C, 32, 4] on qw's device."""
    n, k = qw.shape
    check_shape(QType.FP8, n, k, qw.name or "weight")
    np_, c = -(-n // TILE) * TILE, k // 32
    b = _pad_rows(qw.data.view(torch.uint8), np_).view(np_ // TILE, 2, 8, c, 2, 4, 4)  # t half r c j q kk
    b = b.permute(0, 3, 2, 5, 4, 1, 6)                                    # t c r q j half kk
    b = b[..., list(FP8_BYTE_ORDER)].contiguous()                         # bytes k0 k2 k1 k3
    return b.reshape(np_ // TILE, c, 32, 4, 4).view(torch.int32).reshape(np_ // TILE, c, 32, 4).contiguous()


def global_scale(qw: QWeight) -> float:
    """The fp32 factor the kernel applies at the end (global scale with the decode bias folded)."""
    s = float(qw.scale_2) if qw.qtype is QType.NVFP4 else float(qw.scale)
    return s * FOLD[qw.qtype]


# ---------------------------------------------------------------------------- emulated decode
def _bits_to_f16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)


def decode_nvfp4(words: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                 scale_2: float) -> torch.Tensor:
    """Emulate the kernel's register decode of a QPN2 layout -> float32 [N, K] (tests)."""
    w = words.to(torch.int64) & 0xFFFFFFFF                                # t c l j
    t_, c = w.shape[:2]
    half2 = {  # the four half2 registers of cuda/qpn.cu dec_fp4: (half, kk pair)
        (0, 0): w & 0x8E008E00,
        (1, 0): (w << 3) & 0x8E008E00,
        (0, 2): ((w << 9) & 0x0E000E00) | ((w << 2) & 0x80008000),
        (1, 2): ((w << 6) & 0x0E000E00) | ((w << 1) & 0x80008000),
    }
    vals = torch.empty(t_, c, 32, 4, 2, 4, dtype=torch.float32)           # t c l j half kk
    for (half, kk), h in half2.items():
        vals[..., half, kk] = _bits_to_f16(h & 0xFFFF) * 2.0 ** 14
        vals[..., half, kk + 1] = _bits_to_f16((h >> 16) & 0xFFFF) * 2.0 ** 14
    sw = scales.to(torch.int64).view(t_, c, 8, 2, 4)                      # t c r w byte
    word = sw[..., 0] | (sw[..., 1] << 8) | (sw[..., 2] << 16) | (sw[..., 3] << 24)
    even, odd = (word << 7) & 0x3F803F80, (word >> 1) & 0x3F803F80       # t c r w
    s = torch.empty(t_, c, 8, 4, 2, dtype=torch.float32)                  # t c r j half
    for wi in range(2):
        for parity, h in ((0, even), (1, odd)):
            s[:, :, :, 2 * wi + parity, 0] = _bits_to_f16(h[..., wi] & 0xFFFF) * 2.0 ** 8
            s[:, :, :, 2 * wi + parity, 1] = _bits_to_f16((h[..., wi] >> 16) & 0xFFFF) * 2.0 ** 8
    vals = vals.view(t_, c, 8, 4, 4, 2, 4)                                # t c r q j half kk
    vals = vals * s.view(t_, c, 8, 1, 4, 2, 1)
    full = vals.permute(0, 5, 2, 1, 4, 3, 6).reshape(t_ * 16, c * 64)     # t half r c j q kk
    return full[:n, :k] * scale_2


def decode_fp8(words: torch.Tensor, n: int, k: int, scale: float) -> torch.Tensor:
    """Emulate the kernel's register decode of a QPN8 layout -> float32 [N, K] (tests)."""
    w = words.to(torch.int64) & 0xFFFFFFFF                                # t c l (j half)
    t_, c = w.shape[:2]
    k01 = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)
    k23 = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)
    vals = torch.stack([_bits_to_f16(k01 & 0xFFFF), _bits_to_f16((k01 >> 16) & 0xFFFF),
                        _bits_to_f16(k23 & 0xFFFF), _bits_to_f16((k23 >> 16) & 0xFFFF)], dim=-1)
    vals = vals.view(t_, c, 8, 4, 2, 2, 4) * 2.0 ** 8                     # t c r q j half kk
    full = vals.permute(0, 5, 2, 1, 4, 3, 6).reshape(t_ * 16, c * 32)
    return full[:n, :k] * scale

"""Quantized tensor formats: NVFP4 (E2M1 + E4M3 block scales + fp32 global scale) and FP8 E4M3.

Legend: N = out features (rows), K = in features (columns), G = K // 16 groups per row.

NVFP4, ModelOpt layout, for a Linear [N, K]:
    weight         uint8   [N, K/2]   byte j = element 2j (low nibble) | element 2j+1 (high nibble)
    weight_scale   e4m3fn  [N, K/16]  one scale per 16-element group
    weight_scale_2 float32 []         global scale
    value = E2M1[nibble] * fp32(weight_scale) * weight_scale_2
FP8 per tensor: weight e4m3fn [N, K], weight_scale float32 []; value = fp8 * weight_scale.
"""
from __future__ import annotations

import enum

import numpy as np
import torch

GROUP = 16  # NVFP4 elements per block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# E2M1 magnitudes by the 3 low bits; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = np.array(list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES], dtype=np.float32)


class QType(enum.Enum):
    """Storage type of one linear weight."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    FP8 = "fp8"        # e4m3fn, per-tensor fp32 scale
    NVFP4 = "nvfp4"    # e2m1 packed, e4m3 per-16 scale, fp32 global scale

    @property
    def is_quantized(self) -> bool:
        return self in (QType.FP8, QType.NVFP4)


DENSE_DTYPES = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}


def e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (0x7F / 0xFF are NaN), computed from the bit layout."""
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 0x7
        if exp == 0xF and man == 0x7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * (man / 8.0) * 2.0 ** -6
        else:
            out[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3_TABLE = e4m3_table()


# byte -> its two E2M1 values, low nibble first: [256, 2] fp32 (one lookup per byte, not per nibble)
_E2M1_PAIRS = torch.from_numpy(np.stack([E2M1_TABLE[np.arange(256) & 15], E2M1_TABLE[np.arange(256) >> 4]], 1))


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    return torch.from_numpy(E2M1_TABLE)[codes.long()]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]; low nibble is the even element."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> packed uint8 [..., K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes ({codes.shape[-1]})")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def fp8_to_float(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bits) -> float32."""
    if t.dtype == torch.uint8:
        return torch.from_numpy(E4M3_TABLE)[t.long()]
    return t.to(torch.float32)


def dequant_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_scale_2: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 [N, K/2] u8 + [N, K/16] e4m3 + scalar -> float32 [N, K]."""
    n, half_k = weight.shape
    k = half_k * 2
    if weight_scale.shape != (n, k // GROUP):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} != {(n, k // GROUP)}")
    vals = _E2M1_PAIRS.to(weight.device)[weight.long()].view(n, k // GROUP, GROUP)  # [N, K/16, 16]
    scales = fp8_to_float(weight_scale).view(n, k // GROUP, 1)
    return (vals * scales * float(weight_scale_2)).view(n, k)


def dequant_fp8(weight: torch.Tensor, weight_scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 e4m3fn [N, K] + scalar scale -> float32 [N, K]."""
    return fp8_to_float(weight) * float(weight_scale)


def _div(t: torch.Tensor, d: float) -> torch.Tensor:
    """t / d rounded as IEEE division on every device: torch on CUDA computes a tensor over a Python number as t times
    1 / d, one bit off in places (36 FP8 codes of the test model's linears), so hybrid-quantize --device cuda would not
    give the CPU's bytes; over a tensor on t's device it divides."""
    return t / torch.tensor(d, dtype=t.dtype, device=t.device)


def _e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes (>= 0) rounded onto E2M1's grid as floats, half to even, saturating at 6: step 0.5 below 2, 1
    below 4, 2 up to 6 (torch.round is half-to-even)."""
    a = a.clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.round(a / step) * step


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8), round half to even, saturating at +-6.

    The grid has step 0.5 below 2, 1 below 4 and 2 up to 6; torch.round is half-to-even.
    """
    v = _e2m1_magnitude(x.abs())
    code = torch.where(v <= 2, v * 2, torch.where(v == 3, 5.0, torch.where(v == 4, 6.0, 7.0))).to(torch.uint8)
    return code | ((torch.signbit(x) & (code > 0)).to(torch.uint8) << 3)


def nvfp4_global_scale(amax: float) -> float:
    """weight_scale_2 = amax / (6 * 448); 1.0 for an all-zero tensor."""
    amax = float(amax)
    return amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0


# Block scales NVFP4 quantizers choose: "amax" (ModelOpt's max calibration: a block's largest magnitude lands on
# E2M1's 6) or "mse" (of the amax scale times each SCALE_SEARCH factor, rounded to e4m3, the one with the least
# squared error over the block's 16 values: about 18% less weight error on the tiny model's linears, see
# results/quality.md; ties keep the earlier factor, so amax where nothing is better).
SCALES = ("amax", "mse")
SCALE_SEARCH = (1.0, 0.75, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1)


def _in_scale_units(blocks: torch.Tensor, scale_fp8: torch.Tensor, weight_scale_2: float):
    """blocks [N, G, 16] over their block's whole scale (e4m3 block scale [N, G] x weight_scale_2; 0 where that
    scale is 0) -> (that [N, G, 16], the scales [N, G, 1] as f32)."""
    scale_f = (scale_fp8.to(torch.float32) * weight_scale_2).unsqueeze(-1)
    return torch.where(scale_f > 0, blocks / torch.where(scale_f > 0, scale_f, 1.0), 0.0), scale_f


def _e2m1_codes(blocks: torch.Tensor, scale_fp8: torch.Tensor, weight_scale_2: float) -> torch.Tensor:
    """blocks [N, G, 16] f32 at e4m3 block scales [N, G] -> E2M1 codes u8 [N, G, 16]."""
    return round_to_e2m1(_in_scale_units(blocks, scale_fp8, weight_scale_2)[0])


def _block_error(mags: torch.Tensor, scale_fp8: torch.Tensor, weight_scale_2: float,
                 importance: torch.Tensor | None = None) -> torch.Tensor:
    """The squared error per block [N, G] of magnitudes [N, G, 16] rounded onto E2M1 at e4m3 block scales [N, G]
    (_e2m1_magnitude: round_to_e2m1's rounding; the sign is kept exactly, so magnitudes are enough), each input
    column's error weighted by importance [G, 16] when given."""
    a, scale_f = _in_scale_units(mags, scale_fp8, weight_scale_2)
    err = (mags - _e2m1_magnitude(a) * scale_f).square()
    return _sum16(err if importance is None else err * importance)


def _sum16(e: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [...]: the sum as a fixed tree of elementwise adds, so every device adds in the same order and
    the mse search picks the same scales on a GPU as on the CPU (torch's sum orders them by device and kernel)."""
    for half in (8, 4, 2, 1):
        e = e[..., :half] + e[..., half:2 * half]
    return e[..., 0]


def quantize_nvfp4(w: torch.Tensor, weight_scale_2: float | None = None, scales: str = "amax",
                   importance: torch.Tensor | None = None):
    """float [N, K] -> (weight u8 [N, K/2], weight_scale e4m3fn [N, K/16], weight_scale_2 f32 []).

    Pass weight_scale_2 to share a global scale between linears that share an input; scales: how each block's
    scale is chosen (SCALES); importance [K] (>= 0: the mean squared input of each column, llama.cpp's imatrix
    statistic): "mse" then weighs each column's squared error by it. Each row's result depends on that row alone
    (row chunks give the same bits).
    """
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(f"NVFP4 needs a 2-D weight with in-features divisible by {GROUP}, "
                         f"got shape {tuple(w.shape)}")
    if scales not in SCALES:
        raise ValueError(f"NVFP4 block scales {scales!r}: expected one of {', '.join(SCALES)}")
    if importance is not None and (scales != "mse" or tuple(importance.shape) != (w.shape[1],)):
        raise ValueError(f"NVFP4 importance: expected [{w.shape[1]}] with scales='mse', got "
                         f"{list(importance.shape)} with {scales!r}")
    w = w.detach().to(torch.float32)
    n, k = w.shape
    if weight_scale_2 is None:
        weight_scale_2 = nvfp4_global_scale(w.abs().max())
    weight_scale_2 = float(weight_scale_2)
    blocks = w.view(n, k // GROUP, GROUP)
    base = _div(blocks.abs().amax(dim=-1), E2M1_MAX * weight_scale_2).clamp(max=E4M3_MAX)
    scale_fp8 = base.to(torch.float8_e4m3fn)
    if scales == "mse":
        mags = blocks.abs()
        imp = None if importance is None else importance.to(w.device, torch.float32).view(k // GROUP, GROUP)
        err = _block_error(mags, scale_fp8, weight_scale_2, imp)
        for f in SCALE_SEARCH[1:]:
            s = (base * f).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
            e = _block_error(mags, s, weight_scale_2, imp)
            take = e < err
            err = torch.where(take, e, err)
            scale_fp8 = torch.where(take, s, scale_fp8)
    codes = _e2m1_codes(blocks, scale_fp8, weight_scale_2)
    packed = pack_nibbles(codes.view(n, k))
    return packed, scale_fp8, torch.tensor(weight_scale_2, dtype=torch.float32)


def fp8_scale(amax: float) -> float:
    """weight_scale = amax / 448; 1.0 for an all-zero tensor."""
    amax = float(amax)
    return amax / E4M3_MAX if amax > 0 else 1.0


def quantize_fp8(w: torch.Tensor, scale: float | None = None):
    """float [N, K] -> (weight e4m3fn [N, K], weight_scale f32 []), per-tensor amax / 448.

    Pass scale to quantize part of a tensor with the whole tensor's scale."""
    w = w.detach().to(torch.float32)
    if scale is None:
        scale = fp8_scale(w.abs().max())
    q = _div(w, scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, torch.tensor(scale, dtype=torch.float32)

"""QPN prepacked layouts: the kernel's register decode (emulated bit for bit) equals the reference
dequantization exactly, for NVFP4 (incl. negative block scales and padded rows) and FP8."""
import pytest
import torch

from hybrid.checkpoint.formats import QType, quantize_fp8, quantize_nvfp4
from hybrid.checkpoint.qweight import QWeight
from hybrid.kernels import layout


def nvfp4(n, k, seed=0, negate=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    p, s, s2 = quantize_nvfp4(w)
    sb = s.view(torch.uint8).clone()
    for r, c in negate:
        sb[r, c] |= 0x80
    return QWeight(QType.NVFP4, (n, k), p, sb.view(torch.float8_e4m3fn), s2)


def fp8(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8(torch.randn(n, k, generator=g))
    return QWeight(QType.FP8, (n, k), q, s)


@pytest.mark.parametrize("n,k", [(16, 64), (40, 192), (200, 320)])
def test_nvfp4_decode_bit_exact(n, k):
    qw = nvfp4(n, k, seed=n, negate=[(3, 1), (n - 1, k // 16 - 1)])
    words, scales = layout.pack_nvfp4(qw)
    assert words.dtype == torch.int32 and tuple(words.shape) == (-(-n // 16), k // 64, 32, 4)
    assert tuple(scales.shape) == (-(-n // 16), k // 64, 8, 8)
    got = layout.decode_nvfp4(words, scales, n, k, float(qw.scale_2))
    assert torch.equal(got, qw.dequantize())


def test_nvfp4_all_codes_and_scales():
    """Every E2M1 code against every positive e4m3 scale byte (NaN excluded)."""
    n, k = 16, 2048
    codes = torch.arange(16, dtype=torch.uint8).repeat(n * k // 16).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sb = torch.arange(n * k // 16, dtype=torch.int64).remainder(0x7F).to(torch.uint8).view(n, k // 16)
    qw = QWeight(QType.NVFP4, (n, k), packed, sb.view(torch.float8_e4m3fn), torch.tensor(0.75))
    words, scales = layout.pack_nvfp4(qw)
    assert torch.equal(layout.decode_nvfp4(words, scales, n, k, 0.75), qw.dequantize())


@pytest.mark.parametrize("n,k", [(16, 32), (40, 160), (7, 96)])
def test_fp8_decode_bit_exact(n, k):
    qw = fp8(n, k, seed=k)
    words = layout.pack_fp8(qw)
    assert tuple(words.shape) == (-(-n // 16), k // 32, 32, 4)
    assert torch.equal(layout.decode_fp8(words, n, k, float(qw.scale)), qw.dequantize())


def test_fp8_all_codes():
    b = torch.arange(256, dtype=torch.int64)
    b = b[(b & 0x7F) != 0x7F].to(torch.uint8)  # e4m3fn NaN codes are not preserved (documented)
    data = b.repeat(8192 // len(b) + 1)[:8192].view(16, 512)
    qw = QWeight(QType.FP8, (16, 512), data.view(torch.float8_e4m3fn), torch.tensor(1.0))
    assert torch.equal(layout.decode_fp8(layout.pack_fp8(qw), 16, 512, 1.0), qw.dequantize())


@pytest.mark.parametrize("qtype,k", [(QType.NVFP4, 48), (QType.NVFP4, 100), (QType.FP8, 40)])
def test_shapes_the_kernels_cannot_take_are_rejected(qtype, k):
    with pytest.raises(ValueError, match="multiple of"):
        layout.check_shape(qtype, 16, k)


def test_global_scale_folds_decode_bias():
    qw = nvfp4(16, 64)
    assert layout.global_scale(qw) == pytest.approx(float(qw.scale_2) * 2 ** 7)
    qf = fp8(16, 64)
    assert layout.global_scale(qf) == pytest.approx(float(qf.scale) * 2 ** 8)


def test_fp16_group_scale_product_is_exact():
    """The kernel multiplies the decoded E2M1 half (v * 2^-14) by S = scale * 2^7 in fp16: for every
    code and every e4m3 scale magnitude, S is exact, and the product equals v * scale * 2^-7 exactly."""
    from hybrid.checkpoint.formats import E2M1_TABLE, E4M3_TABLE

    codes = torch.arange(16)
    wbits = ((codes & 8) << 12) | ((codes & 7) << 9)
    w16 = wbits.to(torch.int16).view(torch.float16)                      # v * 2^-14
    mags = torch.arange(0x7F)                                            # scale bytes, NaN excluded
    sbits = (mags << 7).to(torch.int16).view(torch.float16)              # scale * 2^-8
    s16 = sbits * torch.tensor(32768.0, dtype=torch.float16)             # scale * 2^7
    e4m3 = torch.from_numpy(E4M3_TABLE)[mags]
    assert torch.equal(s16.float(), e4m3 * 2.0 ** 7)
    prod = w16.view(16, 1) * s16.view(1, -1)                             # fp16 multiply
    want = torch.from_numpy(E2M1_TABLE).view(16, 1) * e4m3.view(1, -1) * 2.0 ** -7
    assert torch.equal(prod.float(), want)

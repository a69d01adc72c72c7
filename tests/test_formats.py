"""NVFP4 / FP8 formats against independent references: decode tables, nibble order, rounding, bounds."""
import math

import numpy as np
import pytest
import torch

from hybrid.checkpoint.formats import (
    E2M1_TABLE, E4M3_TABLE, GROUP, decode_e2m1, dequant_fp8, dequant_nvfp4, fp8_to_float,
    nvfp4_global_scale, pack_nibbles, quantize_fp8, quantize_nvfp4, round_to_e2m1, unpack_nibbles)

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_from_bits(code: int) -> float:
    """E2M1 from its definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def test_e2m1_decode_all_16_codes_bit_exact():
    ref = torch.tensor([e2m1_from_bits(c) for c in range(16)], dtype=torch.float32)
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))   # bit-exact, -0 included
    assert torch.signbit(got[8]) and got[8] == 0
    assert np.array_equal(E2M1_TABLE.view(np.int32), ref.numpy().view(np.int32))


def test_e2m1_fp16_register_trick():
    """((n&8)<<12)|((n&7)<<9) as fp16 bits == value * 2^-14 (DESIGN §4), all 16 codes."""
    n = torch.arange(16, dtype=torch.int32)
    bits = (((n & 8) << 12) | ((n & 7) << 9)).to(torch.int16)
    got = bits.view(torch.float16).float() * 2.0 ** 14
    assert torch.equal(got, decode_e2m1(n.to(torch.uint8)))


def test_e4m3_decode_all_256_bytes_vs_torch():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = b.view(torch.float8_e4m3fn).float()                        # torch's own decode
    table = torch.from_numpy(E4M3_TABLE)
    nan = torch.isnan(ref)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(table), nan)
    assert torch.equal(table[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert torch.equal(fp8_to_float(b)[~nan], ref[~nan])               # the uint8 path
    assert float(table.nan_to_num(0).abs().max()) == 448.0


def test_e4m3_fp16_register_trick():
    """((b&0x80)<<8)|((b&0x7F)<<7) as fp16 bits == value * 2^-8 for every non-NaN byte."""
    b = torch.arange(256, dtype=torch.int32)
    ok = (b & 0x7F) != 0x7F
    bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16)
    got = bits.view(torch.float16).float() * 2.0 ** 8
    assert torch.equal(got[ok], torch.from_numpy(E4M3_TABLE)[ok])


def test_nibble_order_low_is_even_element():
    codes = torch.tensor([[0x1, 0xA, 0x7, 0x8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0xA1, 0x87]]
    allbytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, -1)
    un = unpack_nibbles(allbytes)
    assert torch.equal(un[0, 0::2], allbytes[0] & 0xF) and torch.equal(un[0, 1::2], allbytes[0] >> 4)
    assert torch.equal(pack_nibbles(un), allbytes)
    with pytest.raises(ValueError, match="odd"):
        pack_nibbles(torch.zeros(1, 3, dtype=torch.uint8))


def brute_force_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude by distance, ties to the even code, saturating at 6; sign unless 0."""
    a = x.abs().clamp(max=6.0).unsqueeze(-1)
    d = (a - E2M1_GRID).abs()                                          # [..., 8]
    best = d.min(dim=-1, keepdim=True).values
    idx = torch.arange(8).expand_as(d)
    cand = torch.where(d == best, idx, torch.full_like(idx, 99))
    even = torch.where(cand % 2 == 0, cand, torch.full_like(cand, 99)).min(-1).values
    code = torch.where(even < 99, even, cand.min(-1).values)
    return (code | ((torch.signbit(x) & (code > 0)).long() << 3)).to(torch.uint8)


def test_round_half_even_ties_and_saturation():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    # ties go to the even code (even mantissa): 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor(mids + [-m for m in mids])
    got = decode_e2m1(round_to_e2m1(x))
    assert got.tolist() == want + [-w if w else 0.0 for w in want]
    sat = torch.tensor([6.0, 6.5, 7.0, 100.0, 1e30, -7.0, -1e30])
    assert decode_e2m1(round_to_e2m1(sat)).tolist() == [6.0] * 5 + [-6.0] * 2
    assert round_to_e2m1(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [0, 0, 0]   # no -0 code


def test_round_matches_brute_force_on_a_dense_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.arange(-64, 65) / 8.0, torch.randn(20000, generator=g) * 3,
                   torch.tensor(mids_eps())])
    assert torch.equal(round_to_e2m1(x), brute_force_e2m1(x))


def mids_eps() -> list[float]:
    out = []
    for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        lo, hi = np.nextafter(np.float32(m), np.float32(0)), np.nextafter(np.float32(m), np.float32(9))
        out += [float(lo), float(hi), -float(lo), -float(hi)]
    return out


def half_step(x: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing at magnitude x (x in [0, 6])."""
    return torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))


def nvfp4_bound(w: torch.Tensor, scale_fp8: torch.Tensor, scale_2: float) -> torch.Tensor:
    """Per-element |err| bound: half an E2M1 step at |w|/s times s (s = fp32(block scale) * scale_2),
    plus what saturation at 6 loses when the e4m3 block scale rounded down."""
    n, k = w.shape
    s = (scale_fp8.float() * scale_2).repeat_interleave(GROUP, dim=1)   # [N, K]
    x = torch.where(s > 0, w.abs() / s.clamp(min=1e-38), torch.zeros_like(w))
    return half_step(x.clamp(max=6)) * s + (w.abs() - 6 * s).clamp(min=0) + 1e-7 * w.abs()


def spread_weights(n=64, k=256, seed=0) -> torch.Tensor:
    """Rows and 16-blocks of very different magnitude, some all-zero blocks, exact ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    w = w * torch.logspace(-1, 1, k // GROUP).repeat_interleave(GROUP)
    w[3, 16:32] = 0
    return w


def test_quantize_nvfp4_follows_the_published_recipe():
    w = spread_weights()
    packed, scale, s2 = quantize_nvfp4(w)
    n, k = w.shape
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (n, k // GROUP)
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert math.isclose(float(s2), float(w.abs().max()) / (6 * 448), rel_tol=1e-6)
    block_amax = w.view(n, k // GROUP, GROUP).abs().amax(-1)
    ref_scale = (block_amax / (6 * float(s2))).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    s = (scale.float() * float(s2)).repeat_interleave(GROUP, dim=1)
    x = torch.where(s > 0, w / s.clamp(min=1e-38), torch.zeros_like(w))
    assert torch.equal(unpack_nibbles(packed), brute_force_e2m1(x))


def test_quantize_nvfp4_ties_go_to_even():
    """amax 10.5 -> scale_2 = 2^-8 and block scale 448 exactly, so w / 1.75 hits the midpoints."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    w = torch.cat([mids, -mids]).view(1, 16) * 1.75
    packed, scale, s2 = quantize_nvfp4(w)
    assert float(s2) == 2.0 ** -8 and scale.float().tolist() == [[448.0]]
    got = decode_e2m1(unpack_nibbles(packed))[0].tolist()
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert got == want + [-v if v else 0.0 for v in want]


def test_nvfp4_error_within_format_bound():
    for seed in range(3):
        w = spread_weights(seed=seed)
        packed, scale, s2 = quantize_nvfp4(w)
        err = (dequant_nvfp4(packed, scale, s2) - w).abs()
        assert bool((err <= nvfp4_bound(w, scale, float(s2))).all())
        # and the bound itself is the format's: never more than one (block amax / 6) * 17/16
        block_amax = w.abs().view(w.shape[0], -1, GROUP).amax(-1).repeat_interleave(GROUP, dim=1)
        normal = scale.float().repeat_interleave(GROUP, dim=1) >= 2 ** -6
        assert bool((err[normal] <= block_amax[normal] / 6 * 17 / 16 + 1e-6).all())
        assert torch.equal(dequant_nvfp4(packed, scale.view(torch.uint8), s2), dequant_nvfp4(packed, scale, s2))


def test_nvfp4_mse_scales_never_worse_per_block():
    """scales="mse": every block's squared error at most amax's (the amax scale is the first candidate), the total
    clearly lower, each block's scale one of the candidates, row chunks the same bits, a zero block zero."""
    from hybrid.checkpoint.formats import E2M1_MAX, E4M3_MAX, SCALE_SEARCH

    w = spread_weights(seed=5)
    w[3, :GROUP] = 0
    gs = nvfp4_global_scale(w.abs().max())
    a, m = quantize_nvfp4(w, gs), quantize_nvfp4(w, gs, scales="mse")
    block_err = lambda q: (dequant_nvfp4(*q) - w).square().view(w.shape[0], -1, GROUP).sum(-1)  # noqa: E731
    ea, em = block_err(a), block_err(m)
    assert bool((em <= ea).all()) and float(em.sum()) < 0.9 * float(ea.sum())
    assert not torch.equal(a[1].view(torch.uint8), m[1].view(torch.uint8)) and torch.equal(a[2], m[2])
    base = (w.view(w.shape[0], -1, GROUP).abs().amax(-1) / (E2M1_MAX * gs)).clamp(max=E4M3_MAX)
    cands = torch.stack([(base * f).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float() for f in SCALE_SEARCH])
    assert bool((cands == m[1].float()).any(0).all())
    top = quantize_nvfp4(w[:5], gs, scales="mse")
    assert torch.equal(top[0], m[0][:5]) and torch.equal(top[1].view(torch.uint8), m[1][:5].view(torch.uint8))
    assert not m[0][3, :GROUP // 2].any() and float(m[1][3, 0].float()) == 0
    with pytest.raises(ValueError, match="block scales 'best'"):
        quantize_nvfp4(w, scales="best")


def test_block_error_sums_in_a_fixed_order():
    """The mse search's block sums are a fixed tree of adds (lane i + lane i + 8, then + 4, + 2, + 1), so a GPU picks
    the CPU's scales: bit for bit that tree, within rounding of torch's sum."""
    from hybrid.checkpoint.formats import _sum16

    e = torch.rand(7, 5, 16, generator=torch.Generator().manual_seed(2)) * torch.logspace(-6, 2, 16)
    want = e.clone()
    for half in (8, 4, 2, 1):
        want = torch.stack([want[..., i] + want[..., i + half] for i in range(half)], -1)
    assert torch.equal(_sum16(e), want[..., 0])
    assert torch.allclose(_sum16(e), e.sum(-1), rtol=1e-6)


def test_nvfp4_importance_weighs_the_search():
    """importance [K]: the weighted error of the chosen scales at most the unweighted choice's, per block; uniform
    importance the unweighted choice itself; a wrong shape, or importance without "mse", a one-line ValueError."""
    w = spread_weights(seed=9)
    k = w.shape[1]
    gs = nvfp4_global_scale(w.abs().max())
    imp = torch.rand(k, generator=torch.Generator().manual_seed(3)) ** 4 * 10
    plain, weighted = quantize_nvfp4(w, gs, "mse"), quantize_nvfp4(w, gs, "mse", importance=imp)
    werr = lambda q: ((dequant_nvfp4(*q) - w).square() * imp).view(w.shape[0], -1, GROUP).sum(-1)  # noqa: E731
    assert bool((werr(weighted) <= werr(plain) + 1e-12).all()) and float(werr(weighted).sum()) < float(werr(plain).sum())
    same = quantize_nvfp4(w, gs, "mse", importance=torch.full((k,), 3.0))
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1].view(torch.uint8), plain[1].view(torch.uint8))
    with pytest.raises(ValueError, match=r"importance: expected \[%d\] with scales='mse'" % k):
        quantize_nvfp4(w, gs, "mse", importance=imp[:-16])
    with pytest.raises(ValueError, match="with 'amax'"):
        quantize_nvfp4(w, gs, importance=imp)


def test_fp8_error_within_format_bound():
    w = spread_weights(seed=7)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.dim() == 0
    assert math.isclose(float(scale), float(w.abs().max()) / 448, rel_tol=1e-6)
    err = (dequant_fp8(q, scale) - w).abs()
    # half an ulp: 2^-4 relative for normals, 2^-10 * scale absolute in the subnormal range
    bound = w.abs() * 2 ** -4 + 2 ** -10 * float(scale) + 1e-7 * w.abs()
    assert bool((err <= bound).all())
    assert float(dequant_fp8(q, scale).abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)


def test_shared_scale_2_across_a_group():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(64, 64, generator=g) * s for s in (1.0, 0.3, 3.0))
    shared = nvfp4_global_scale(max(float(t.abs().max()) for t in (q, k, v)))
    outs = [quantize_nvfp4(t, shared) for t in (q, k, v)]
    assert len({float(o[2]) for o in outs}) == 1 and float(outs[0][2]) == pytest.approx(shared, rel=1e-7)
    for t, (packed, scale, s2) in zip((q, k, v), outs):
        assert not torch.isnan(scale.float()).any() and float(scale.float().max()) <= 448
        err = (dequant_nvfp4(packed, scale, s2) - t).abs()
        assert bool((err <= nvfp4_bound(t, scale, float(s2))).all())
    # the largest member's largest block uses the top of the e4m3 range
    assert float(outs[2][1].float().max()) == 448.0


def test_all_zero_weight_quantizes_to_zero():
    packed, scale, s2 = quantize_nvfp4(torch.zeros(4, 32))
    assert float(s2) == 1.0 and not packed.any() and not scale.float().any()
    q, sc = quantize_fp8(torch.zeros(4, 4))
    assert float(sc) == 1.0 and not q.float().any()


def test_nvfp4_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        quantize_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequant_nvfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3).to(torch.float8_e4m3fn), 1.0)


def test_dequant_nvfp4_bit_exact_against_per_nibble_decode_on_edge_codes():
    """The byte-pair table gives exactly E2M1[nibble] x fp32(scale) x scale_2 (signs of zeros too)."""
    import numpy as np

    from hybrid.checkpoint.formats import unpack_nibbles
    from tests.test_cpu_kernels import rand_nvfp4

    rng = np.random.default_rng(7)
    for n, k in ((64, 128), (48, 256)):
        q = rand_nvfp4(n, k, rng)                 # +-0, +-6, smallest and largest block scales
        per_nibble = decode_e2m1(unpack_nibbles(q.data)).view(n, k // GROUP, GROUP)
        want = (per_nibble * fp8_to_float(q.scale).view(n, k // GROUP, 1) * float(q.scale_2)).view(n, k)
        got = dequant_nvfp4(q.data, q.scale, q.scale_2)
        assert got.dtype == torch.float32 and got.shape == (n, k)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))

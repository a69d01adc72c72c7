"""The prefill tiled GEMM (cuda/qpn.cu gemm_body) emulated on the CPU, index for index: which thread
loads which packed word, where its decoded fp16 values land in shared memory (tile_store), the
K tail (FP8 K = 32 mod 64), rows past M / N; and the launcher's tile choice. The bit decode itself
is layout.py's (tested in test_qpn_layout.py); the WMMA products are checked on a GPU
(test_qpn_cuda.py)."""
import itertools

import numpy as np
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import layout
from hybrid.kernels.qpn import GEMM_TILES, PREFILL_MIN, gemm_splits, gemm_tile, prefill_plan
from tests.test_qpn_layout import fp8, nvfp4

THREADS, PBK, SBK = 256, 64, 32


def max_scale_weight(qtype: QType, n: int = 96, k: int = 1024):
    """Largest codes and block scales: NVFP4 +-6 x +-448 (negative scales folded into the signs at
    prepack) with some rows at the smallest subnormal scale 2^-9; FP8 +-448 with some 2^-9 codes."""
    from hybrid.checkpoint.qweight import QWeight

    g = torch.Generator().manual_seed(7)
    if qtype is QType.NVFP4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        codes[:, 0::3], codes[:, 1::3] = 7, 15                            # +6, -6
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
        sc = torch.full((n, k // 16), 0x7E, dtype=torch.uint8)          # 448
        sc[::5, ::2] = 0xFE                                               # -448
        sc[1::7] = 0x01                                                   # 2^-9
        return QWeight(qtype, (n, k), data, sc.view(torch.float8_e4m3fn), torch.tensor(1e-4))
    b = torch.full((n, k), 0x7E, dtype=torch.uint8)                       # 448
    b[:, 1::2] |= 0x80
    b[::3, ::5] = 0x01
    return QWeight(qtype, (n, k), b.view(torch.float8_e4m3fn), torch.tensor(1e-3))


def _h2(v: int) -> tuple[float, float]:
    """u32 holding two fp16 -> (lo, hi) as floats."""
    a = np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16)
    return float(a[0]), float(a[1])


def _dec_fp4(w):
    return (w & 0x8E008E00, (w << 3) & 0x8E008E00, ((w << 9) & 0x0E000E00) | ((w << 2) & 0x80008000),
            ((w << 6) & 0x0E000E00) | ((w << 1) & 0x80008000))


def _dec_fp8(w):
    return (((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80),
            (w & 0x80008000) | ((w >> 1) & 0x3F803F80))


def _mask(v):
    return v & 0xFFFFFFFF


def _store_slot(ws, fmt, words, scales, t_glob, c, l, row0, h):
    """tile_store<H = h> for one (tile, chunk, lane) slot: writes ws[row0 + r (+8), 0..31]."""
    q, r = l & 3, l >> 2
    wv = [_mask(int(v)) for v in words[t_glob, c, l]]
    row = row0 + r
    if fmt == 2:
        sv = int.from_bytes(bytes(scales[t_glob, c, r].tolist()), "little")
        for jj in range(2):                                              # group j = 2 h + jj
            sw = (sv >> (32 * h)) & 0xFFFFFFFF
            hs = _mask((sw >> 1) if jj else (sw << 7)) & 0x3F803F80
            s_lo, s_hi = (v * 2.0 ** 15 for v in _h2(hs))                # dec_scale: scale * 2^7
            p0, p1, p2, p3 = (_mask(p) for p in _dec_fp4(wv[2 * h + jj]))
            k = 16 * jj + 4 * q
            vals_r = [v * s_lo for v in _h2(p0) + _h2(p2)]               # hmul2_splat(., lo)
            vals_r8 = [v * s_hi for v in _h2(p1) + _h2(p3)]
            ws[row, k:k + 4] = torch.tensor(vals_r, dtype=torch.float64)
            ws[row + 8, k:k + 4] = torch.tensor(vals_r8, dtype=torch.float64)
    else:
        for word, dr, dk in ((wv[0], 0, 0), (wv[1], 8, 0), (wv[2], 0, 16), (wv[3], 8, 16)):
            a, b = (_mask(p) for p in _dec_fp8(word))
            k = dk + 4 * q
            ws[row + dr, k:k + 4] = torch.tensor(_h2(a) + _h2(b), dtype=torch.float64)


def emulate_gemm(x: torch.Tensor, qw, bm: int, bn: int, splits: int = 1) -> torch.Tensor:
    """y[M, N] float64 as gemm_body<FMT, bm, bn> computes it (fp32 sums emulated in float64): load
    sets of 64 k, each decoded in two stages of 32 k; split-K partials summed in split order."""
    fmt = 2 if qw.qtype is QType.NVFP4 else 8
    n, k = qw.shape
    m = x.shape[0]
    if fmt == 2:
        words, scales = layout.pack_nvfp4(qw)
    else:
        words, scales = layout.pack_fp8(qw), None
    words = words.to(torch.int64) & 0xFFFFFFFF
    gs = layout.global_scale(qw)
    cpt = 1 if fmt == 2 else 2
    c_all, tiles, nk, ns = k // (64 if fmt == 2 else 32), -(-n // 16), -(-k // PBK), k // SBK
    ks_per = -(-nk // splits)
    wv_n = -(-(bn // 16 * cpt * 32) // THREADS)
    y = torch.full((m, n), float("nan"), dtype=torch.float64)                # poisoned output
    nan = float("nan")
    for mb in range(-(-m // bm)):
        for nb in range(-(-n // bn)):
            m0, t0 = mb * bm, nb * bn // 16
            parts = []
            for kb in range(0, nk, ks_per):                                # K splits
                acc = torch.zeros(bm, bn, dtype=torch.float64)
                for st in range(2 * kb, min(2 * (kb + ks_per), ns)):       # stages of 32 k
                    kt, h = st // 2, st % 2
                    xs = torch.full((bm, SBK), nan, dtype=torch.float64)   # unloaded rows: NaN
                    ws = torch.full((bn, SBK), nan, dtype=torch.float64)
                    seen = set()
                    for tid in range(THREADS):                             # weights
                        for v in range(wv_n):
                            i = tid + THREADS * v
                            l, t, cc = i & 31, (i >> 5) % (bn // 16), (i >> 5) // (bn // 16)
                            if cc == (0 if fmt == 2 else h) and t0 + t < tiles:
                                assert (t, cc, l) not in seen and kt * cpt + cc < c_all
                                seen.add((t, cc, l))
                                _store_slot(ws, fmt, words, scales, t0 + t, kt * cpt + cc, l, 16 * t, h)
                    for tid in range(THREADS):                             # x
                        for v in range(bm * (PBK // 8) // THREADS):
                            i = tid + THREADS * v
                            row, hv, kk = (i >> 2) % bm, (i >> 2) // bm, 8 * (i & 3)
                            if hv == h and m0 + row < m:
                                k0 = kt * PBK + SBK * h + kk
                                xs[row, kk:kk + 8] = x[m0 + row, k0:k0 + 8].double()
                    acc += xs @ ws.t()
                parts.append(acc)
            tot = parts[0]
            for p in parts[1:]:
                tot = tot + p
            for r in range(bm):                                            # epilogue bounds
                for col in range(bn):
                    if m0 + r < m and nb * bn + col < n:
                        y[m0 + r, nb * bn + col] = tot[r, col] * gs
    return y


@pytest.mark.parametrize("qtype,n,k,m,tile,splits", [
    (QType.NVFP4, 200, 128, 17, (32, 64), 1),    # N not a multiple of the tile, M not of BM
    (QType.NVFP4, 72, 192, 40, (64, 128), 2),    # split-K: 2 + 1 k-steps
    (QType.FP8, 200, 96, 33, (32, 64), 1),       # K = 32 mod 64: the last set has one stage
    (QType.FP8, 40, 160, 70, (64, 64), 2),
])
def test_emulated_gemm_matches_reference(qtype, n, k, m, tile, splits):
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    y = emulate_gemm(x, qw, *tile, splits=splits)
    assert not torch.isnan(y).any(), "an output was not written or read a stale/unwritten value"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    # the reference dequantizes in fp32: agreement to ~1e-7 of the largest output; a misplaced
    # element would be off by O(1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_tile_choice():
    sms = 132
    assert gemm_tile(128, 151936, sms, k=2048) == (128, 128)    # lm_head: plenty of blocks
    assert gemm_tile(512, 4096, sms, k=2048) == (128, 128)      # q_proj M = 512: 128 blocks, unsplit
    assert gemm_tile(128, 4096, sms, k=2048) == (128, 128)      # q_proj M = 128: 32 blocks x 4 splits
    assert gemm_tile(64, 2048, sms, k=4096) == (64, 128)        # o_proj M = 64: 16 x 8 (64x64: 32 x 4, more smem)
    assert gemm_tile(64, 4096, sms, k=2048) == (64, 128)        # BM no larger than M rounded up (>= 64)
    assert gemm_tile(64, 512, sms, k=2048) == (64, 64)          # k_proj: 16 x 8 splits beat 8 x 8
    assert gemm_tile(64, 25600, sms, k=5120) == (64, 128)       # 200 blocks: 64x64's 400 take two waves
    assert gemm_tile(17, 151936, sms) == (64, 128)
    assert gemm_tile(100, 10 ** 6, sms) == (128, 128)
    assert gemm_tile(512, 151936, 80, sm=70) == (128, 128)      # Volta: the same tiles
    for bm, bn in GEMM_TILES:
        assert gemm_tile(1000, 64, sms, f"{bm}x{bn}") == (bm, bn)
    with pytest.raises(ValueError, match="PREFILL_VARIANT"):
        gemm_tile(100, 100, sms, "16x16")
    with pytest.raises(ValueError, match="PREFILL_VARIANT"):
        gemm_tile(100, 100, sms, "big")


def test_split_choice():
    sms = 132
    assert gemm_splits(512, 151936, 2048, (128, 128), sms) == (1, 32)     # lm_head fills the device
    assert gemm_splits(512, 4096, 2048, (128, 128), sms) == (1, 32)       # q_proj: 128 blocks, one per SM
    assert gemm_splits(512, 5120, 25600, (128, 128), sms) == (4, 100)     # dense_down: 160 blocks, 2 on some SMs
    assert gemm_splits(64, 5120, 25600, (64, 128), sms) == (6, 67)        # dense_down: 40 blocks x 6, two per SM
    assert gemm_splits(64, 2048, 4096, (64, 128), sms) == (8, 8)          # 16 tiles: 256 KB of partials a tile
    assert gemm_splits(64, 2048, 4096, (64, 64), sms) == (4, 16)          # o_proj: 32 tiles x 4 (x 8: same load)
    assert gemm_splits(64, 512, 4096, (64, 64), sms) == (16, 4)           # 8 tiles x 16
    assert gemm_splits(64, 2048, 768, (64, 128), sms) == (3, 4)           # expert_down: >= 4 k-steps a split
    assert gemm_splits(64, 2048, 256, (64, 128), sms) == (1, 4)           # too short to split
    assert gemm_splits(128, 4096, 4096, (128, 128), sms) == (4, 16)       # 32 blocks, partials cap
    assert gemm_splits(128, 4096, 4096, (64, 128), 80) == (5, 13)         # 64 blocks on 80 SMs: 320 x 13 k-steps
    assert gemm_splits(64, 2048, 4096, (64, 128), sms, force=3) == (3, 22)  # 22 + 22 + 20
    assert gemm_splits(64, 2048, 96, (64, 128), sms, force=16) == (2, 1)    # at most one per k-step
    assert gemm_splits(64, 2048, 4096, (64, 128), sms, force=1) == (1, 64)
    for m, n, k in ((17, 100, 64), (300, 5000, 1056), (64, 512, 25600)):
        for force in (None, 1, 5, 40):
            splits, ks = gemm_splits(m, n, k, (64, 64), sms, force=force)
            nk = -(-k // 64)
            assert (splits - 1) * ks < nk <= splits * ks, "every split non-empty, all k-steps covered"


def test_prefill_plan():
    assert prefill_plan(2, 16, 4096, 2048, 132, 90) is None
    assert prefill_plan(2, 512, 4096, 2048, 132, 90, "mt") is None
    p = prefill_plan(2, 64, 5120, 25600, 132, 90, "wmma")
    assert (p.kernel, p.grid, p.ks, p.label) == ("qpn2_gemm_64x128", (1, 40, 6), 67, "gemm_64x128/s6")
    p = prefill_plan(8, 512, 151936, 2048, 132, 90, "wmma")
    assert (p.kernel, p.grid, p.label) == ("qpn8_gemm_128x128", (4, 1187, 1), "gemm_128x128")
    assert prefill_plan(8, 512, 151936, 2048, 132, 70).kernel == "qpn8_gemm_128x128"  # below sm_80: WMMA
    assert prefill_plan(8, 512, 151936, 2048, 80, 70).kernel == "qpn8_gemm_128x128"
    assert prefill_plan(8, 128, 8192, 4096, 132, 90, "128x128").grid == (1, 64, 2)  # 128 blocks, one per SM
    assert prefill_plan(2, 64, 2048, 4096, 132, 90, "32x64", 2).grid == (2, 32, 2)


def test_prefill_kernel_routing():
    def kernel(fmt, m, n, sms, choice=None, k=4096, sm=90):
        plan = prefill_plan(fmt, m, n, k, sms, sm, choice)
        return None if plan is None else plan.kernel

    assert kernel(2, PREFILL_MIN, 4096, 132) is None
    assert kernel(2, PREFILL_MIN + 1, 151936, 132).startswith("qpn2_gemmf_")        # sm_80+: gemmf
    assert kernel(2, PREFILL_MIN + 1, 151936, 80, sm=70).startswith("qpn2_gemm_")   # Volta: WMMA
    assert kernel(2, PREFILL_MIN + 1, 151936, 80, sm=75).startswith("qpn2_gemm_")
    assert kernel(2, 64, 4096, 132, "wmma", k=2048) == "qpn2_gemm_64x128"   # split over K (prefill_plan)
    assert kernel(2, 512, 4096, 132, "f128x128") == "qpn2_gemmf_128x128"
    assert kernel(8, 64, 4096, 132, "f64x256") == "qpn8_gemmf_64x256"
    assert kernel(2, 512, 4096, 132, "f128x128", sm=70) == kernel(2, 512, 4096, 132, sm=70)  # no gemmf: WMMA pick
    with pytest.raises(ValueError, match="f128x128"):
        kernel(2, 512, 4096, 132, "f32x32")
    assert kernel(8, 512, 4096, 132, "mt") is None
    assert kernel(8, 512, 4096, 132, "64x128") == "qpn8_gemm_64x128"


def test_gemmf_tile_and_splits():
    """The sm_80+ picker: BM no larger than M rounded up (>= 64); a grid that would leave SMs idle is
    split over K; a forced split count is kept; every plan covers the problem."""
    from hybrid.kernels.qpn import GEMMF_TILES, gemmf_tile

    sms = 132
    assert gemmf_tile(64, 151936, 2048, sms)[0] == 64
    assert gemmf_tile(17, 4096, 2048, sms)[0] == 64
    p = prefill_plan(2, 64, 5120, 25600, sms, 90)        # dense_down M = 64: 40 or 20 tiles alone
    assert p.kernel.startswith("qpn2_gemmf_") and p.grid[2] > 1
    assert prefill_plan(2, 64, 5120, 25600, sms, 90, None, 1).grid[2] == 1
    for m in (17, 64, 100, 512):
        for n, k in ((4096, 2048), (2048, 4096), (151936, 2048), (768, 2048), (5, 128)):
            for fmt in (2, 8):
                p = prefill_plan(fmt, m, n, k, sms, 90)
                fam, tile = p.kernel.split("_", 1)[1].split("_")
                bm, bn = (int(v) for v in tile.split("x"))
                assert (bm, bn) in (GEMMF_TILES if fam == "gemmf" else GEMM_TILES)
                assert p.grid[0] * bm >= m and p.grid[1] * bn >= n and p.grid[2] * p.ks * 64 >= k
    for fmt in (2, 8):                                    # forced gemmf tiles stay gemmf on sm_80+
        for bm, bn in GEMMF_TILES:
            assert prefill_plan(fmt, 64, 768, 2048, sms, 90, f"f{bm}x{bn}").kernel == f"qpn{fmt}_gemmf_{bm}x{bn}"


# The sm_80+ default on the shapes of H200 device call 3 (tools/gemm_probe.sh 93ed732, results/
# cuda_kernels.md "sm_80+ prefill GEMM"): (fmt, M, N, K) -> plan label; the measured best of the
# WMMA pick and the three gemmf tiles unless noted (us: picked / best / the default before).
PICKS = [
    (2, 512, 151936, 2048, "gemm_128x128"),       # lm_head: WMMA 1214 / 1168 (gemmf 64x256) / 1299
    (2, 128, 151936, 2048, "gemmf_64x256"),       # 295 / 295 / 332 (both: modelled ties, 1178 vs 1180)
    (2, 64, 151936, 2048, "gemmf_64x256"),        # 165 / 165 / 170
    (2, 64, 25600, 5120, "gemmf_64x256"),         # dense_up 82.0 / 82.0 / 92.7
    (2, 512, 25600, 5120, "gemmf_64x256"),        # 545 / 545 / 575
    (2, 512, 5120, 25600, "gemmf_64x256/s4"),     # dense_down 518 / 518 / 582
    (2, 64, 5120, 25600, "gemmf_64x128/s6"),      # 90.8 / 90.8 / 91.4
    (2, 512, 4096, 2048, "gemmf_64x256"),         # q_proj 35.9 / 35.9 / 41.4
    (2, 128, 4096, 2048, "gemmf_64x256/s4"),      # 24.8 / 24.8 / 26.1
    (2, 512, 2048, 4096, "gemmf_64x256/s2"),      # o_proj 47.6 / 47.6 / 49.1
    (2, 64, 768, 2048, "gemm_64x64/s8"),          # expert_gate_up: WMMA 14.3 / 14.3 / 18.2
    (2, 128, 768, 2048, "gemm_64x64/s5"),         # 15.3 / 15.3 / 18.8
    (2, 512, 768, 2048, "gemmf_64x256/s4"),       # 23.9 / 23.9 / 25.2
    (8, 512, 5120, 25600, "gemm_128x128/s4"),     # FP8 dense_down: WMMA 563 / 563 / 687
    (8, 128, 5120, 25600, "gemmf_64x256/s3"),     # 171 / 171 / 181
    (8, 64, 768, 2048, "gemm_64x64/s8"),          # FP8 expert_gate_up 14.1 / 14.1 / 18.6
    (8, 64, 25600, 5120, "gemmf_64x256"),         # FP8 dense_up 97.2 / 97.2 / 101
    (8, 512, 4096, 2048, "gemmf_64x256"),         # FP8 q_proj 39.0 / 39.0 / 44.5
    (8, 512, 151936, 2048, "gemm_128x128"),       # FP8 lm_head: WMMA 1262 / 1262 / 1439
    (8, 128, 151936, 2048, "gemm_128x128"),       # 323 / 323 / 382
]


@pytest.mark.parametrize("fmt,m,n,k,label", PICKS)
def test_sm90_default_picks(fmt, m, n, k, label):
    assert prefill_plan(fmt, m, n, k, 132, 90).label == label


@pytest.mark.parametrize("sm,sms", [(70, 80), (75, 40)])
def test_below_sm80_picks_wmma(sm, sms):
    for fmt, m, n, k, _ in PICKS:
        p = prefill_plan(fmt, m, n, k, sms, sm)
        assert p.kernel.startswith(f"qpn{fmt}_gemm_"), p.kernel
        bm, bn = gemm_tile(m, n, sms, None, sm, k)
        assert p.kernel == f"qpn{fmt}_gemm_{bm}x{bn}" and p.grid[2:] == gemm_splits(m, n, k, (bm, bn), sms)[:1]


def test_cost_model_against_measured_rows():
    """gemmf_cost / gemm_us against a few H200 rows of call 3 (93ed732), within the fit's worst 15%."""
    from hybrid.kernels.qpn import gemm_us, gemmf_cost

    sms = 132
    rows = [  # (cost, fmt, m, n, k, tile, splits, measured us)
        (gemmf_cost, 2, 512, 151936, 2048, (64, 256), 1, 1168.0),
        (gemmf_cost, 2, 512, 151936, 2048, (128, 128), 1, 1585.7),
        (gemmf_cost, 2, 512, 151936, 2048, (64, 128), 1, 1299.3),
        (gemmf_cost, 8, 512, 5120, 25600, (64, 256), 4, 632.4),
        (gemmf_cost, 2, 64, 768, 2048, (64, 128), 8, 18.1),
        (gemm_us, 2, 512, 151936, 2048, (128, 128), 1, 1214.2),   # 36 blocks per SM, two at a time
        (gemm_us, 2, 512, 4096, 2048, (128, 128), 1, 46.6),       # one block per SM
        (gemm_us, 8, 512, 5120, 25600, (128, 128), 4, 562.6),
        (gemm_us, 2, 64, 768, 2048, (64, 64), 8, 14.3),
        (gemm_us, 2, 64, 5120, 25600, (64, 128), 6, 104.8),
    ]
    for cost, fmt, m, n, k, tile, splits, us in rows:
        nk = -(-k // 64)
        got = cost(m, n, tile, sms, splits, -(-nk // splits), fmt)
        assert abs(got / us - 1) < 0.15, (cost.__name__, fmt, m, n, k, tile, splits, got, us)


def test_prefill_variant_from_environment():
    import os
    import subprocess
    import sys

    code = "from hybrid.kernels import qpn; print(qpn.PREFILL_VARIANT[0])"
    env = {**os.environ, "HYBRID_QPN_PREFILL": "mt"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "mt"


def test_m1_kernel_choice(monkeypatch):
    from hybrid.kernels.qpn import PAIR_MIN_TILES, linear_kernel

    monkeypatch.setenv("HYBRID_QPN_TB", "0")   # the register-pipeline picks (the bulk rings: test_tb_kernel_choice)
    big, small = 16 * PAIR_MIN_TILES, 16 * PAIR_MIN_TILES - 16
    assert linear_kernel(2, 1, 1, 90, n=big) == "qpn2_linear_m1_as2"     # two tiles per warp
    assert linear_kernel(2, 1, 1, 90, n=small) == "qpn2_linear_m1_as"
    assert linear_kernel(2, 1, 3, 90, n=big) == "qpn2_linear_mt1_t2u1"   # M = 3..8: the 8-row tile, two tiles
    assert linear_kernel(2, 1, 8, 90, n=small) == "qpn2_linear_mt1"
    assert linear_kernel(2, 1, 2, 90, n=big) == "qpn2_linear_mp2_as2"    # M = 2: the column trick
    assert linear_kernel(2, 1, 2, 90, n=small) == "qpn2_linear_mp2_as"
    assert linear_kernel(8, 1, 2, 90, n=big) == "qpn8_linear_mt1_t2u1"   # FP8: no group scales, no column trick
    assert linear_kernel(2, 1, 2, 70, n=big) == "qpn2_linear_mt1"        # Volta: no cp.async
    assert linear_kernel(2, 1, 5, 90, "_mp", n=small) == "qpn2_linear_mp8_as"
    assert linear_kernel(2, 1, 3, 90, "_mpx2", n=small) == "qpn2_linear_mp4_as2"
    assert linear_kernel(2, 1, 1, 90, "_mp", n=small) == "qpn2_linear_m1_as"   # forced where it applies
    assert linear_kernel(2, 1, 4, 70, "_mp", n=big) == "qpn2_linear_mt1"
    assert linear_kernel(8, 1, 1, 90, n=big) == "qpn8_linear_mt1_t2u1"   # FP8: no M = 1 kernel
    assert linear_kernel(8, 1, 1, 90, n=small) == "qpn8_linear_mt1"
    assert linear_kernel(2, 1, 1, 70, n=big) == "qpn2_linear_mt1"        # Volta: no cp.async, one tile
    assert linear_kernel(2, 2, 9, 90, n=big) == "qpn2_linear_mt2"
    assert linear_kernel(2, 1, 1, 90, "_m1", n=big) == "qpn2_linear_m1_as"
    assert linear_kernel(2, 1, 1, 90, "_m1x2", n=16) == "qpn2_linear_m1_as2"
    assert linear_kernel(2, 1, 1, 70, "_m1x2", n=big) == "qpn2_linear_mt1"
    assert linear_kernel(2, 1, 8, 90, "_m1x2", n=small) == "qpn2_linear_mt1"


def test_tb_kernel_choice(monkeypatch):
    """sm_90+: the bulk-copy ring kernels where the H200 measured them faster (FP8 at any M, NVFP4 at M = 1..4 through
    the column trick, at M = 5..8 below PAIR_MIN_TILES tiles; FP8 above it), never below sm_90, never with
    HYBRID_QPN_TB=0, not the column-trick ones with =mt; a bad value is one line."""
    from hybrid.errors import HybridError
    from hybrid.kernels.qpn import PAIR_MIN_TILES, linear_kernel, tb_smem

    big, small = 16 * PAIR_MIN_TILES, 16 * PAIR_MIN_TILES - 16
    monkeypatch.delenv("HYBRID_QPN_TB", raising=False)
    assert linear_kernel(2, 1, 5, 90, n=small) == "qpn2_linear_mt1_tb1u4"
    assert linear_kernel(2, 1, 8, 90, n=small) == "qpn2_linear_mt1_tb1u4"
    assert linear_kernel(2, 1, 8, 90, n=big, k=2048) == "qpn2_linear_mt1_t2u1"   # lm_head: the register pipeline
    assert linear_kernel(2, 1, 8, 90, n=big, k=5120) == "qpn2_linear_mt1_tbu2"   # long rows: the two-tile ring
    # NVFP4 M = 1: the column trick through a bulk ring, slots of 4 or (long rows, or lm_head's K) 8 chunks, two
    # tiles per warp in slots of 4 on a large grid of long rows; M = 2: the cp.async column trick
    # M = 2 as M = 1 (its column-trick kernel, two rows); M = 3, 4 the four-row one, slots of 4, two tiles per warp
    # only on a large grid of long rows
    for m, n, k, want in ((1, small, 4096, "m1_tbu4"), (1, small, 25600, "m1_tbu8"), (1, big, 2048, "m1_tbu8"),
                          (1, big, 5120, "m1_tb2u4"), (2, small, 2048, "mp2_tbu4"), (2, small, 25600, "mp2_tbu8"),
                          (2, big, 2048, "mp2_tbu8"), (2, big, 5120, "mp2_tb2u4"), (3, small, 25600, "mp4_tbu4"),
                          (4, big, 2048, "mp4_tbu4"), (4, big, 5120, "mp4_tb2u4")):
        assert linear_kernel(2, 1, m, 90, n=n, k=k) == f"qpn2_linear_{want}", (m, n, k)
    assert linear_kernel(2, 1, 1, 80, n=small, k=4096) == "qpn2_linear_m1_as"
    assert linear_kernel(2, 1, 2, 80, n=small) == "qpn2_linear_mp2_as"
    assert linear_kernel(2, 1, 2, 90, "_mp2tbu8", n=small) == "qpn2_linear_mp2_tbu8"   # forced
    assert linear_kernel(2, 1, 3, 90, "_mp4tb2u4", n=small) == "qpn2_linear_mp4_tb2u4"  # forced, below MP rows
    assert linear_kernel(2, 1, 3, 90, "_mp2tbu8", n=small) == "qpn2_linear_mp4_tbu4"   # forced at the wrong M: default
    assert linear_kernel(2, 1, 1, 90, "_mp2tbu8", n=small, k=4096) == "qpn2_linear_m1_tbu4"   # M = 1: its own kernels
    assert linear_kernel(8, 1, 1, 90, "_m1tbu4", n=small) == "qpn8_linear_mt1_tb1u4"   # not NVFP4: the default
    with pytest.raises(ValueError, match="LINEAR_VARIANT '_m2x'"):   # no such kernel: said, not launched
        linear_kernel(2, 1, 2, 90, "_m2x", n=small)
    assert linear_kernel(8, 1, 1, 90, n=small) == "qpn8_linear_mt1_tb1u4"
    assert linear_kernel(8, 1, 8, 90, n=big) == "qpn8_linear_mt1_tbu2"
    assert linear_kernel(8, 1, 1, 80, n=small) == "qpn8_linear_mt1"        # sm_80: no bulk copies
    assert linear_kernel(2, 1, 5, 70, n=small) == "qpn2_linear_mt1"
    assert linear_kernel(8, 1, 4, 80, "_tb1u4", n=small) == "qpn8_linear_mt1"   # forced below sm_90: the default
    # M = 9..16: the rings of two 8-row tiles of x, two 16-row tiles per warp on large grids or long rows
    assert linear_kernel(2, 2, 9, 90, n=big, k=2048) == "qpn2_linear_mt2_tbu2"
    assert linear_kernel(8, 2, 16, 90, n=small, k=25600) == "qpn8_linear_mt2_tbu2"
    assert linear_kernel(2, 2, 16, 90, n=small, k=4096) == "qpn2_linear_mt2_tb1u4"
    assert linear_kernel(2, 2, 16, 90, "_tbu2", n=small, k=4096) == "qpn2_linear_mt2_tbu2"   # forced
    assert linear_kernel(2, 2, 16, 80, "_tbu2", n=small) == "qpn2_linear_mt2"   # below sm_90: the register pipeline
    assert linear_kernel(2, 4, 32, 90, n=big) == "qpn2_linear_mt4_tb1u4"      # MT = 4: one tile per warp
    # prefill of 17..32 rows through the 8-row tiles (not the GEMMs) on weights of at most 4096 x 2048, sm_90+
    from hybrid.kernels.qpn import tile_prefill

    assert tile_prefill(17, 2048, 4096, 90, None) and tile_prefill(32, 512, 2048, 90, None)
    assert not tile_prefill(16, 2048, 4096, 90, None)        # M <= 16: the 8-row-tile kernels anyway
    assert not tile_prefill(33, 2048, 4096, 90, None)
    assert not tile_prefill(24, big, 2048, 90, None)         # large weights: the GEMMs
    assert not tile_prefill(24, 5120, 25600, 90, None)       # long rows below PAIR_MIN_TILES tiles too
    assert not tile_prefill(24, 2048, 4096, 80, None)        # sm_80: the GEMMs
    assert not tile_prefill(24, 2048, 4096, 90, "f64x128")   # a forced prefill kernel
    assert linear_kernel(8, 4, 32, 90, "_tbu2", n=big) == "qpn8_linear_mt4_tb1u4"   # forced: its one ring
    monkeypatch.setenv("HYBRID_QPN_TB", "mt")   # all but the NVFP4 M <= 4 column-trick rings
    assert linear_kernel(2, 1, 1, 90, n=small, k=4096) == "qpn2_linear_m1_as"
    assert linear_kernel(2, 1, 1, 90, n=big, k=2048) == "qpn2_linear_m1_as2"
    assert linear_kernel(2, 1, 2, 90, n=small) == "qpn2_linear_mp2_as"
    assert linear_kernel(2, 1, 4, 90, n=small) == "qpn2_linear_mt1_tb1u4"
    assert linear_kernel(8, 1, 1, 90, n=small) == "qpn8_linear_mt1_tb1u4"
    monkeypatch.setenv("HYBRID_QPN_TB", "0")
    assert linear_kernel(8, 1, 1, 90, n=small) == "qpn8_linear_mt1"
    assert linear_kernel(2, 2, 16, 90, n=big) == "qpn2_linear_mt2"
    assert not tile_prefill(24, 2048, 4096, 90, None)
    assert linear_kernel(2, 1, 1, 90, n=small, k=4096) == "qpn2_linear_m1_as"
    assert linear_kernel(8, 1, 4, 90, "_tbu2", n=small) == "qpn8_linear_mt1_tbu2"   # forced: still the ring
    monkeypatch.setenv("HYBRID_QPN_TB", "yes")
    with pytest.raises(HybridError, match="HYBRID_QPN_TB='yes'"):
        linear_kernel(8, 1, 1, 90, n=small)
    # dynamic shared memory: 8 warps x 2 slots x NT x U x 576 bytes + 8-byte barriers
    assert tb_smem("_tb1u4") == 8 * 2 * 4 * 576 + 8 * 2 * 8
    assert tb_smem("_tbu2") == 8 * 2 * 2 * 2 * 576 + 8 * 2 * 8
    assert tb_smem("qpn2_linear_mt2_tbu2") == 8 * 2 * 2 * 2 * 576 + 8 * 2 * 8
    assert tb_smem("qpn8_linear_mt4_tb1u4") == 8 * 2 * 4 * 576 + 8 * 2 * 8   # its partials (16 KiB) fit in the rings
    assert tb_smem("_m1tbu8") == tb_smem("qpn2_linear_m1_tbu8") == 8 * 2 * 8 * 576 + 8 * 2 * 8
    assert tb_smem("_mp2tb2u4") == 8 * 2 * 2 * 4 * 576 + 8 * 2 * 8


def test_seq_kernel_choice(monkeypatch):
    """qpn2_linear_m1_seq: NVFP4 M = 1 on sm_90+ by default (HYBRID_QPN_TB and HYBRID_QPN_SEQ at 1) or forced
    ("_m1seq"), on weights of at least two tiles per warp of a wave whose rows are whole ring slots; its grid a
    first wave of sms x per_sm blocks and a block per 8 further tiles; a bad switch value is one line."""
    from hybrid.errors import HybridError
    from hybrid.kernels.qpn import linear_kernel, seq_grid, use_seq

    monkeypatch.delenv("HYBRID_QPN_TB", raising=False)
    monkeypatch.delenv("HYBRID_QPN_SEQ", raising=False)
    assert use_seq(2, 1, 90, None)
    assert not use_seq(8, 1, 90, None) and not use_seq(2, 2, 90, None) and not use_seq(2, 1, 80, None)
    assert not use_seq(2, 1, 90, "_m1tbu8")            # another forced kernel keeps its own
    assert seq_grid(9496, 32, 132, 3) == (396, 396 + 395)   # lm_head 151936 x 2048 on an H200: 6336 + 3160 tiles
    assert seq_grid(2 * 396 * 8, 32, 132, 3) == (396, 396)  # exactly two tiles per warp: no second wave
    assert seq_grid(2 * 396 * 8 - 1, 32, 132, 3) is None    # fewer: ct_tb_choice's kernel
    assert seq_grid(1600, 80, 132, 3) is None               # dense_up
    assert seq_grid(9496, 30, 132, 3) is None               # rows not whole slots of 8 chunks
    assert seq_grid(9496, 32, 132, 0) is None
    assert linear_kernel(2, 1, 1, 90, "_m1seq", n=151936, k=2048) == "qpn2_linear_m1_tbu8"   # where it does not fit
    monkeypatch.setenv("HYBRID_QPN_SEQ", "0")
    assert not use_seq(2, 1, 90, None)
    assert use_seq(2, 1, 90, "_m1seq")                 # forced: still tried
    monkeypatch.setenv("HYBRID_QPN_SEQ", "1")
    monkeypatch.setenv("HYBRID_QPN_TB", "mt")          # no bulk-ring column trick at M = 1: not this one either
    assert not use_seq(2, 1, 90, None)
    monkeypatch.setenv("HYBRID_QPN_TB", "1")
    monkeypatch.setenv("HYBRID_QPN_SEQ", "2")
    with pytest.raises(HybridError, match="HYBRID_QPN_SEQ='2'"):
        use_seq(2, 1, 90, None)


def test_linear_route(monkeypatch):
    """qpn_linear's launch (and hybrid-bench's kernel column) on an sm_90 / sm_80 device: the two-tile first wave
    for lm_head at M = 1, the rings of two / four 8-row tiles at M = 16 / 24 on a small weight, wgmma for lm_head at
    M = 24, the tiled GEMM on sm_80; with scale rows not 16-byte aligned, no bulk-copy kernel."""
    from hybrid.kernels.qpn import SEQ_NAME, linear_route

    class Mod:
        def __init__(self, sm):
            self.sm = sm

        def occupancy(self, name, threads, smem):
            assert name == SEQ_NAME
            return 2

    for var in ("HYBRID_QPN_TB", "HYBRID_QPN_SEQ", "HYBRID_QPN_SM90"):
        monkeypatch.delenv(var, raising=False)
    kind, geo = linear_route(Mod(90), 2, 1, 151936, 2048, 132)
    assert kind == "seq" and geo[0] == 132 * 2
    assert linear_route(Mod(90), 2, 1, 151936, 2048, 132, aligned=False) == ("linear", "qpn2_linear_m1_as")
    assert linear_route(Mod(90), 2, 16, 2048, 4096, 132) == ("linear", "qpn2_linear_mt2_tb1u4")
    assert linear_route(Mod(90), 2, 16, 2048, 4096, 132, aligned=False) == ("linear", "qpn2_linear_mt2")
    assert linear_route(Mod(90), 8, 24, 2048, 4096, 132) == ("linear", "qpn8_linear_mt4_tb1u4")
    assert linear_route(Mod(90), 2, 24, 151936, 2048, 132) == ("wgmma", None)
    kind, plan = linear_route(Mod(80), 2, 64, 4096, 2048, 108)
    assert kind == "gemm" and plan.label.startswith("gemm")


def test_moe_path_and_mt2_switch(monkeypatch):
    """qpn_moe's kernels: the mt1 rings up to 8 tokens; at 9..16 on sm_80+ the two-tile rings where the active slots
    average MOE_MT2_MIN_ROWS rows ($HYBRID_MOE_MT2 auto), always (1) or never (0), else the grouped GEMM; a bad
    value is one line naming the variable."""
    from hybrid.errors import HybridError
    from hybrid.kernels.qpn import MOE_MT2_MIN_ROWS, moe_path

    h, i = 2048, 768
    monkeypatch.delenv("HYBRID_MOE_MT2", raising=False)
    assert moe_path(8, 64, 8, 2, 90, h, i) == (1, "_as", None)
    assert moe_path(16, 128, 8, 2, 90, h, i) == (2, "_as", None)                 # 16 rows a slot
    assert moe_path(MOE_MT2_MIN_ROWS, 8 * MOE_MT2_MIN_ROWS, 8, 8, 90, h, i)[:2] == (2, "_as")   # at the edge
    assert moe_path(16, 128, 16, 2, 90, h, i)[0] == 4                            # 8 rows a slot: the GEMM
    mt, _, plan = moe_path(16, 128, 128, 2, 90, h, i)                            # one row a slot: the GEMM
    assert mt == 4 and plan[0] == "qpn2_moe_gemmf_gateup_32x256"
    assert moe_path(17, 136, 8, 2, 90, h, i)[0] == 4                             # past 16 tokens
    assert moe_path(16, 128, 8, 2, 70, h, i)[0] == 4                             # Volta: no rings
    monkeypatch.setenv("HYBRID_MOE_MT2", "1")
    assert moe_path(16, 128, 128, 8, 90, h, i) == (2, "_as", None)
    monkeypatch.setenv("HYBRID_MOE_MT2", "0")
    assert moe_path(16, 128, 8, 2, 90, h, i)[0] == 4
    assert moe_path(8, 64, 8, 2, 90, h, i)[0] == 1                               # not read below 9 tokens
    monkeypatch.setenv("HYBRID_MOE_MT2", "yes")
    with pytest.raises(HybridError, match="HYBRID_MOE_MT2='yes'"):
        moe_path(16, 128, 8, 2, 90, h, i)


def test_pdl_launch_config_layout_and_switch(monkeypatch):
    """cuLaunchKernelEx's CUlaunchConfig / CUlaunchAttribute as the driver lays them out (x86-64), and the
    programmatic dependent launch only on sm_90+ and as $HYBRID_PDL says."""
    import ctypes

    from hybrid.kernels import qpn
    from hybrid.kernels.driver import LaunchAttribute, LaunchConfig

    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.smem.offset, LaunchConfig.stream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)
    monkeypatch.setenv("HYBRID_PDL", "1")
    assert qpn.pdl(90) and not qpn.pdl(80) and not qpn.pdl(70)
    monkeypatch.setenv("HYBRID_PDL", "qpn")
    assert qpn.pdl(90) and not qpn.pdl(90, "fused")
    monkeypatch.setenv("HYBRID_PDL", "0")
    assert not qpn.pdl(90) and not qpn.pdl(90, "fused")


def test_every_forced_linear_variant_resolves():
    """Every LINEAR_VARIANT choice the GPU tests and the benchmark force names a kernel qpn.cu builds, for both
    formats, M = 1..8, sm_70 / 80 / 90, small and large grids (a choice that does not apply falls back)."""
    from hybrid.kernels.build import KERNELS
    from hybrid.kernels.qpn import CT_TB_KERNELS, M1_KERNELS, PAIR_MIN_TILES, TB_KERNELS, linear_kernel

    choices = [None, "", "_u4", "_as", "_as4", "_mp", "_mpx2", "_t2", "_t2u1", *M1_KERNELS, *TB_KERNELS,
               *CT_TB_KERNELS]
    for choice, fmt, m, sm, n, k in itertools.product(choices, (2, 8), range(1, 9), (70, 80, 90),
                                                      (16 * PAIR_MIN_TILES - 16, 16 * PAIR_MIN_TILES), (2048, 5120)):
        assert linear_kernel(fmt, 1, m, sm, choice, n=n, k=k) in KERNELS, (choice, fmt, m, sm, n, k)

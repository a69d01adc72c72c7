"""The sm_80+ prefill GEMM of cuda/qpn.cu (qpn{2,8}_gemmf_<BM>x<BN>) run on the CPU: its CUDA source
compiled as C++ under the shim of tests/cuda_emu.py with QPN_MMA = 2, the inline-PTX helpers in C++
-- cp.async as an immediate copy, ld.shared, and mma.sync m16n8k16 exchanging the real fragment
layout of the PTX ISA across the warp -- against the torch reference. Catches the permuted
activation layout, the fragment / lane indexing, the ring's stage and slot logic, the FP8 half
stage, the epilogue and split-K without a GPU; timing and the real tensor cores are checked on a
GPU (tests/test_qpn_cuda.py)."""

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build
from hybrid.kernels.qpn import GEMMF_TILES
from tests.cuda_emu import GEMM_HELPERS, SHIM, compile_emu, mma_shim, qpn_head, run_gemm_emu
from tests.test_qpn_layout import fp8, nvfp4

HELPERS = GEMM_HELPERS + r"""
inline void __trap() { abort(); }
inline void cp_async8(u32 dst, const void* src) { memcpy(smem_ptr(dst), src, 8); }
inline void cp_commit() {}
inline void prefetch_l2(const void*) {}
template <int N> inline void cp_wait() {}
inline u32x4 lds128(u32 a) { u32x4 v; memcpy(&v, smem_ptr(a), 16); return v; }
""" + mma_shim("mma_tile")

TILE_NAMES = [f"{bm}x{bn}" for bm, bn in GEMMF_TILES]
RULE = "// " + "-" * 64 + " "


def emu_source() -> str:
    src = build.source()
    head = qpn_head(src)
    helpers = build.device_functions(["dec_fp4", "dec_fp8", "tile_ptrs", "store_y", "store_part", "add_part",
                                      "sum_parts", "last_arrival"], src)
    gemmf = src[src.index(RULE + "prefill GEMM, sm_80+"): src.index(RULE + "MoE routing")]
    assert "asm" not in gemmf + helpers, "an inline-PTX helper the shim does not replace"
    part4 = "inline f32x4 ld_part4(const float* p) { f32x4 v; memcpy(&v, p, 16); return v; }\n"
    entry = "".join(
        f'extern "C" void emu_{f}_{t}(int gx, int gy, int gz, int rev, const u32x4* w, const u64* s, float gs, '
        f'const u16* x, u16* y, int M, int N, int K, int KS, float* part, int* cnt) {{ run_grid(gx, gy, THREADS, '
        f'[&] {{ qpn{f}_gemmf_{t}(w, s, gs, x, y, M, N, K, KS, 1, part, cnt); }}, gz, rev); }}\n'
        for f in (2, 8) for t in TILE_NAMES)
    return (SHIM + "#define __CUDA_ARCH__ 900\n#include <cstdlib>\n" + head
            + "struct __align__(16) f32x4 { float x, y, z, w; };\n" + HELPERS + part4 + helpers + gemmf + entry)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "qpn_gemmf_emu", emu_source())


emu_gemmf = run_gemm_emu


def _check(y, x, qw):
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype,n,k,m,tile", [
    (QType.NVFP4, 200, 320, 17, "64x128"),      # N, M not multiples of the tile; 5 k-steps, 4-stage ring
    (QType.NVFP4, 40, 192, 129, "128x128"),     # warps whose tiles lie past N; 2-stage ring
    (QType.FP8, 72, 352, 33, "64x256"),         # K = 32 mod 64: the last stage holds one chunk
    (QType.FP8, 130, 160, 100, "128x128"),
    (QType.NVFP4, 5, 128, 64, "64x256"),        # N below one 16-row tile, N % 8 != 0
])
def test_emulated_gemmf(emu, qtype, n, k, m, tile):
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    _check(emu_gemmf(emu, x, qw, tile), x, qw)


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_emulated_gemmf_largest_scales(emu, qtype):
    from tests.test_qpn_gemm import max_scale_weight

    qw = max_scale_weight(qtype, 40, 256)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3)).half() * 30
    y = emu_gemmf(emu, x, qw, "64x128")
    assert torch.isfinite(y).all()
    _check(y, x, qw)


@pytest.mark.parametrize("qtype,n,k,m,tile,splits,reverse", [
    (QType.NVFP4, 200, 640, 70, "64x128", 3, False),   # 10 k-steps as 4 + 4 + 2
    (QType.NVFP4, 90, 512, 33, "64x256", 8, True),     # one k-step per split, N % 8 != 0
    (QType.FP8, 72, 480, 40, "128x128", 4, True),      # K = 32 mod 64: the last split ends half-way
])
def test_emulated_gemmf_split_k(emu, qtype, n, k, m, tile, splits, reverse):
    """Split-K: fp32 partials per split, the last block of each output tile to arrive sums them in
    split order (the result does not depend on which block arrives last)."""
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m + splits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + splits)).half()
    y = emu_gemmf(emu, x, qw, tile, splits=splits, reverse=reverse)
    _check(y, x, qw)
    assert torch.equal(y, emu_gemmf(emu, x, qw, tile, splits=splits, reverse=not reverse))

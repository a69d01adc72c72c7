"""The prefill tiled GEMM of cuda/qpn.cu (qpn{2,8}_gemm_<BM>x<BN>) run on the CPU: its CUDA source
compiled as C++ (g++ -std=c++20) under a small shim -- a block's 256 threads as OS threads,
__syncthreads / __syncwarp as barriers, the inline-PTX helpers (loads, fp16 multiplies, WMMA with a
fragment layout of the shim's own) in C++ -- against the torch reference. Catches indexing,
pipeline (register sets, k tail), decode and epilogue errors without a GPU; the real WMMA fragments
and timing are checked on a GPU (tests/test_qpn_cuda.py)."""
import re

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build
from hybrid.kernels.qpn import GEMM_TILES
from tests.cuda_emu import GEMM_HELPERS, SHIM, compile_emu, qpn_head, run_gemm_emu
from tests.test_qpn_layout import fp8, nvfp4

HELPERS = GEMM_HELPERS + r"""
inline u32x4 ld_x16(const u16* p) { u32x4 v; memcpy(&v, p, 16); return v; }
struct f32x4;
inline f32x4 ld_part4(const float* p);
// WMMA 16x16x16 with the shim's fragment layout: lane l holds row (A: m, B: n) l/2, k 8 (l%2) .. +8
// in a[0..3]; accumulator d[0..7] = D[l/2][8 (l%2) + 0..7]. mma exchanges fragments per warp.
static u32 xa[8][32][4], xb[8][32][4];
inline void wmma_ld_a(u32 (&a)[8], u32 addr) {
  const int l = threadIdx.x & 31;
  memcpy(a, smem_ptr(addr) + ((l >> 1) * PLD + 8 * (l & 1)) * 2, 16);
  a[4] = a[5] = a[6] = a[7] = 0;
}
inline void wmma_ld_b(u32 (&b)[8], u32 addr) { wmma_ld_a(b, addr); }  // col-major B: same addressing
inline void wmma_mma(float (&d)[8], const u32 (&a)[8], const u32 (&b)[8]) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  memcpy(xa[w][l], a, 16), memcpy(xb[w][l], b, 16);
  warp_bar[w]->arrive_and_wait();
  const _Float16* A = (const _Float16*)xa[w];  // A[m][k] = A[(2 m + k / 8) * 8 + k % 8]
  const _Float16* B = (const _Float16*)xb[w];
  const int m = l >> 1;
  for (int e = 0; e < 8; ++e) {
    const int n = 8 * (l & 1) + e;
    float s = d[e];
    for (int k = 0; k < 16; ++k) s += (float)A[(2 * m + k / 8) * 8 + k % 8] * (float)B[(2 * n + k / 8) * 8 + k % 8];
    d[e] = s;
  }
  warp_bar[w]->arrive_and_wait();
}
inline void wmma_st(u32 addr, const float (&d)[8]) {
  const int l = threadIdx.x & 31;
  memcpy(smem_ptr(addr) + ((l >> 1) * 16 + 8 * (l & 1)) * 4, d, 32);
}
"""

TILE_NAMES = [f"{bm}x{bn}" for bm, bn in GEMM_TILES]


def emu_source() -> str:
    src = build.source()
    rule = "// " + "-" * 64 + " "
    head = qpn_head(src)
    decode = "".join(re.findall(r"__device__ __forceinline__ void dec_fp[48]\(.*?\n\}\n", src, re.S))
    gemm = src[src.index(rule + "prefill"): src.index(rule + "prefill GEMM, sm_80+")]
    # the inline-PTX helpers are the shim's
    gemm = re.sub(r"__device__ __forceinline__ (u32|u32x4|f32x4|float|void) (ld_x16|ld_part4|ld_part|wmma_ld_a|"
                  r"wmma_ld_b|wmma_mma|wmma_st)\(.*?\n\}\n", "", gemm, flags=re.S)
    assert "asm" not in gemm and "asm" not in decode, "an inline-PTX helper the shim does not replace"
    defines = "".join(re.findall(r"#define (?:PBK|SBK|PLD) .*\n", gemm))   # the shim's WMMA uses PLD
    part4 = "inline f32x4 ld_part4(const float* p) { f32x4 v; memcpy(&v, p, 16); return v; }\n"
    entry = "".join(
        f'extern "C" void emu_{f}_{t}(int gx, int gy, int gz, int rev, const u32x4* w, const u64* s, float gs, '
        f'const u16* x, u16* y, int M, int N, int K, int KS, float* part, int* cnt) {{ run_grid(gx, gy, THREADS, '
        f'[&] {{ qpn{f}_gemm_{t}(w, s, gs, x, y, M, N, K, KS, 1, part, cnt); }}, gz, rev); }}\n'
        for f in (2, 8) for t in TILE_NAMES)
    return SHIM + head + decode + defines + HELPERS + gemm + part4 + entry


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "qpn_gemm_emu", emu_source())


emu_gemm = run_gemm_emu


@pytest.mark.parametrize("qtype,n,k,m,tile", [
    (QType.NVFP4, 200, 320, 17, "32x64"),      # N, M not multiples of the tile; 5 k-steps, PF = 4
    (QType.NVFP4, 136, 256, 70, "64x128"),
    (QType.NVFP4, 40, 192, 129, "128x128"),
    (QType.FP8, 72, 352, 33, "64x64"),          # K = 32 mod 64: the last k-step has one chunk
    (QType.FP8, 130, 160, 100, "128x128"),
    (QType.FP8, 24, 96, 40, "64x128"),
])
def test_emulated_gemm(emu, qtype, n, k, m, tile):
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    y = emu_gemm(emu, x, qw, tile)
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_emulated_gemm_largest_scales(emu, qtype):
    from tests.test_qpn_gemm import max_scale_weight

    qw = max_scale_weight(qtype, 40, 256)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3)).half() * 30
    y = emu_gemm(emu, x, qw, "32x64")
    assert torch.isfinite(y).all()
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype,n,k,m,tile,splits,reverse", [
    (QType.NVFP4, 200, 640, 70, "64x128", 3, False),   # 10 k-steps as 4 + 4 + 2; N % 8 = 0
    (QType.NVFP4, 90, 512, 33, "64x64", 8, True),      # one k-step per split, N % 8 != 0, last block = split 0
    (QType.FP8, 72, 480, 40, "32x64", 4, True),        # K = 32 mod 64: the last split ends half-way through a set
    (QType.FP8, 136, 1056, 129, "128x128", 5, False),
    (QType.NVFP4, 40, 256, 20, "32x64", 16, False),    # more splits asked than k-steps: one per k-step
])
def test_emulated_gemm_split_k(emu, qtype, n, k, m, tile, splits, reverse):
    """Split-K: fp32 partials per split, the last block of each output tile to arrive sums them."""
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m + splits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + splits)).half()
    y = emu_gemm(emu, x, qw, tile, splits=splits, reverse=reverse)
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"
    # the sum runs in split order whichever block arrives last: the result does not depend on it
    assert torch.equal(y, emu_gemm(emu, x, qw, tile, splits=splits, reverse=not reverse))

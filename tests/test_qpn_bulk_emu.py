"""The sm_90+ linear kernels fed by bulk-copy rings (qpn{2,8}_linear_mt{1,2,4}_tb1u4 / mt{1,2}_tbu2: warp_gemm_bulk in
cuda/qpn.cu) run on the CPU: their CUDA source compiled as C++ under the shim of tests/cuda_emu.py with QPN_MMA = 2,
the inline-PTX helpers in C++ -- a bulk copy as an immediate copy that counts its bytes off the slot's mbarrier, the
mbarrier as (completed phases, arrivals, bytes owed) with try_wait.parity's rule (a wait that could never end aborts;
so does a copy from outside the weight),
ld.shared, mma.sync m16n8k16 exchanging the PTX ISA's fragment layout -- against the torch reference. Catches the
slot layout (U chunks of words, then scales, per tile), a slot's short tail, the phase parity, the K split across
warps and the block reduction without a GPU; the copy engine's timing and the real barriers are checked on a GPU
(tests/test_qpn_cuda.py)."""
import ctypes

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build, layout
from hybrid.kernels.qpn import CT_TB_KERNELS, SEQ_SMEM, TB_KERNELS, ct_tb_m, ct_tb_name, seq_grid, tb_smem
from tests.cuda_emu import GEMM_HELPERS, SHFL_XOR, SHIM, compile_emu, mma_shim, qpn_preamble
from tests.test_qpn_layout import fp8, nvfp4

RULE = "// " + "-" * 64 + " "
DYN = 80 * 1024   # the emulation's dynamic shared memory (each kernel's tb_smem is checked below it)

HELPERS = GEMM_HELPERS + SHFL_XOR + r"""
#include <chrono>
#define QPN_BULK 1
inline void __trap() { abort(); }
inline void pdl_wait() {}
inline void pdl_trigger() {}
inline u64 ld_act(const u16* p) { u64 v; memcpy(&v, p, 8); return v; }
inline u32x4 lds128(u32 a) { u32x4 v; memcpy(&v, smem_ptr(a), 16); return v; }
inline u64 lds64(u32 a) { u64 v; memcpy(&v, smem_ptr(a), 8); return v; }
inline u32 lds32(u32 a) { u32 v; memcpy(&v, smem_ptr(a), 4); return v; }
inline float __int_as_float(u32 b) { float f; memcpy(&f, &b, 4); return f; }
// the weight's words and scales ([lo, hi) per tensor, set by the entry point): a bulk copy reads nothing else
static const char *w_lo, *w_hi, *s_lo, *s_hi;
// an mbarrier of one expected arrival: completed phases, arrivals in the current phase, bytes still owed
struct Mbar { short phase, arrived; int owed; };
static_assert(sizeof(Mbar) == 8, "a slot's barrier is 8 bytes (the next slot's follows)");
inline Mbar* mbar(u32 bar) { return (Mbar*)smem_ptr(bar); }
inline void mbar_settle(Mbar* b) {   // the phase completes once its arrival is in and no byte is owed
  if (__atomic_load_n(&b->arrived, __ATOMIC_SEQ_CST) == 1 && __atomic_load_n(&b->owed, __ATOMIC_SEQ_CST) == 0) {
    __atomic_store_n(&b->arrived, (short)0, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&b->phase, (short)1, __ATOMIC_SEQ_CST);
  }
}
inline void mbar_init(u32 bar) { Mbar* b = mbar(bar); b->phase = 0, b->arrived = 0, b->owed = 0; }
inline void mbar_init_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void mbar_expect(u32 bar, u32 bytes) {
  Mbar* b = mbar(bar);
  if (__atomic_load_n(&b->arrived, __ATOMIC_SEQ_CST) != 0) abort();   // a second arrival in one phase
  __atomic_fetch_add(&b->owed, (int)bytes, __ATOMIC_SEQ_CST);
  __atomic_store_n(&b->arrived, (short)1, __ATOMIC_SEQ_CST);
  mbar_settle(b);
}
inline void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  if ((dst | (u32)(uintptr_t)src | bytes) & 15) abort();              // cp.async.bulk: 16-byte aligned, sized
  const char* p = (const char*)src;
  if (!((p >= w_lo && p + bytes <= w_hi) || (p >= s_lo && p + bytes <= s_hi))) abort();
  memcpy(smem_ptr(dst), src, bytes);
  Mbar* b = mbar(bar);
  if (__atomic_sub_fetch(&b->owed, (int)bytes, __ATOMIC_SEQ_CST) < 0) abort();
  mbar_settle(b);
}
// try_wait.parity(p) succeeds once the phase of parity p has completed: completed phases % 2 != p. Lane 0 issues
// every copy, so a lane waiting here 10 s has waited for a phase nothing will complete (a hang on the GPU).
inline void mbar_wait(u32 bar, u32 parity) {
  Mbar* b = mbar(bar);
  const auto t0 = std::chrono::steady_clock::now();
  while ((__atomic_load_n(&b->phase, __ATOMIC_SEQ_CST) & 1) == (int)parity) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10)) abort();
    std::this_thread::yield();
  }
}
// linear_m1_body's / linear_mp_body's cp.async branches (ST > 0), never instantiated here
template <int ST, int NT>
void warp_m1_async(float (&)[NT][4], const u32x4* const (&)[NT], const u64* const (&)[NT], int, int, const u16*, int,
                   unsigned char*);
template <int ST, int NT, int MP>
void warp_mp_async(float (&)[NT][4], const u32x4* const (&)[NT], const u64* const (&)[NT], int, int, const u16*, int,
                   unsigned char*);
""" + mma_shim("mma_tile")

FUNCS = ["dec_fp4", "dec_fp8", "lane_tok", "lane_k", "mma_group", "group_fp4", "group_fp8", "load_x", "chunk",
         "bulk_issue", "bulk_start", "bulk_loop", "slot_chunk", "slot_chunks", "warp_gemm_bulk", "tile_ptrs",
         "store_partials", "red_sum", "zero_acc", "linear_body", "e4m3_mag_f32", "m1_mmas", "m1_scale", "m1_row_sums",
         "m1_slot_pair", "warp_m1_bulk", "linear_m1_body", "mp_chunk", "warp_mp_bulk", "linear_mp_body"]


def emu_source() -> str:
    src = build.source()
    pre = qpn_preamble(src)
    funcs = build.device_functions(FUNCS, src)
    decl = "extern __shared__ __align__(16) unsigned char smem_dynamic[];"
    assert funcs.count(decl) == 3, "linear_body's / linear_m1_body's / linear_mp_body's dynamic shared memory moved"
    funcs = funcs.replace(decl, f"__shared__ __align__(16) unsigned char smem_dynamic[{DYN}];")
    tb = src[src.index("#define LINEAR_TB("): src.index(RULE + "prefill: shared-memory tiled GEMM")]
    tb += src[src.index("#define LINEAR_M1_TB("): src.index(RULE + "NVFP4, M = 2..8 as M = 1 does")]
    assert tb.count(decl) == 1, "linear_m1_seq_body's dynamic shared memory moved"
    tb = tb.replace(decl, f"__shared__ __align__(16) unsigned char smem_dynamic[{DYN}];")
    last = src.index("\n", src.rindex("\nLINEAR_MP_TB(qpn2_") + 1) + 1
    tb += src[src.index("#define LINEAR_MP_TB("): last]
    assert "asm" not in pre[pre.index("#define BULK_SLOT"):] + funcs + tb, "an inline-PTX helper the shim does not replace"
    entry = "".join(
        f'extern "C" void emu_{f}{"" if mt == 1 else f"_mt{mt}"}{v}(int gx, const u32x4* w, long wn, const u64* s, '
        f'long sn, float gs, const u16* x, '
        f'u16* y, int M, int N, int K, int KS) {{ w_lo = (const char*)w, w_hi = w_lo + wn, s_lo = (const char*)s, '
        f's_hi = s_lo + sn; run_grid(gx, 1, THREADS, [&] {{ qpn{f}_linear_mt{mt}{v}(w, s, gs, x, y, M, N, K, KS, 1); '
        f'}}); }}\n'
        for f in (2, 8) for v in TB_KERNELS for mt in (1, 2, 4) if mt < 4 or v == "_tb1u4") + "".join(
        f'extern "C" void emu_2{v}(int gx, const u32x4* w, long wn, const u64* s, long sn, float gs, const u16* x, '
        f'u16* y, int M, int N, int K, int KS) {{ w_lo = (const char*)w, w_hi = w_lo + wn, s_lo = (const char*)s, '
        f's_hi = s_lo + sn; run_grid(gx, 1, THREADS, [&] {{ {ct_tb_name(v)}(w, s, gs, x, y, M, N, K, KS, 1); }}); }}\n'
        for v in CT_TB_KERNELS) + (
        'extern "C" void emu_seq(int gx, const u32x4* w, long wn, const u64* s, long sn, float gs, const u16* x, '
        'u16* y, int N, int K, int B0) { w_lo = (const char*)w, w_hi = w_lo + wn, s_lo = (const char*)s, '
        's_hi = s_lo + sn; run_grid(gx, 1, THREADS, [&] { qpn2_linear_m1_seq(w, s, gs, x, y, N, K, B0); }); }\n')
    return SHIM + "#define __CUDA_ARCH__ 900\n#include <cstdlib>\n" + pre + HELPERS + funcs + tb + entry


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "qpn_bulk_emu", emu_source())


def run(lib, x, qw, variant, ks):
    """y[M, N] from an emulated bulk-ring kernel, KS warps splitting K (the launcher's grid), y poisoned (NaN)."""
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())   # noqa: E731
    i = ctypes.c_int
    n, k = qw.shape
    m = x.shape[0]
    if qw.qtype is QType.NVFP4:
        words, scales = layout.pack_nvfp4(qw)
    else:
        words, scales = layout.pack_fp8(qw), torch.zeros(16, dtype=torch.uint8)
    gs = layout.global_scale(qw)
    fmt = 2 if qw.qtype is QType.NVFP4 else 8
    nt = {**TB_KERNELS, **CT_TB_KERNELS}[variant][2]
    units = -(-(-(-n // 16)) // nt)
    y = torch.full((m, n), float("nan")).half()
    nb = lambda t: ctypes.c_long(t.numel() * t.element_size())   # noqa: E731
    mt = "" if m <= 8 or variant not in TB_KERNELS else "_mt2" if m <= 16 else "_mt4"
    getattr(lib, f"emu_{fmt}{mt}{variant}")(i(-(-units // (8 // ks))), ptr(words), nb(words), ptr(scales), nb(scales),
                                        ctypes.c_float(gs), ptr(x), ptr(y), i(m), i(n), i(k), i(ks))
    return y


def test_emulated_dynamic_shared_memory_fits():
    names = ([*TB_KERNELS, *CT_TB_KERNELS] + [f"qpn{f}_linear_mt2{v}" for f in (2, 8) for v in TB_KERNELS]
             + [f"qpn{f}_linear_mt4_tb1u4" for f in (2, 8)])
    assert max(max(tb_smem(v) for v in names), SEQ_SMEM) <= DYN


@pytest.mark.parametrize("variant", sorted(TB_KERNELS))
@pytest.mark.parametrize("qtype,n,k,m,ks", [
    (QType.NVFP4, 200, 320, 8, 1),     # 5 chunks: slots of 4 (or 2) chunks, the last one short; tiles past N
    (QType.NVFP4, 48, 1024, 3, 4),     # 16 chunks over 4 warps: 4 each, the ring turning
    (QType.NVFP4, 40, 448, 1, 2),      # 7 chunks over 2 warps (3 and 4): odd tails
    (QType.FP8, 72, 352, 5, 2),        # FP8: 11 chunks of 32 k, no scales copied
    (QType.FP8, 16, 1536, 8, 1),       # 48 chunks on one warp: the parity over many turns
    (QType.NVFP4, 200, 320, 16, 1),    # M = 9..16: the two 8-row tiles of x (qpn2_linear_mt2_*)
    (QType.NVFP4, 48, 1024, 11, 4),    # rows past M in the second tile re-read row M - 1, never written
    (QType.FP8, 72, 352, 9, 2),
    (QType.NVFP4, 200, 320, 32, 1),    # M = 17..32: four 8-row tiles (qpn2_linear_mt4_tb1u4; one tile per warp)
    (QType.FP8, 48, 1024, 19, 4),
])
def test_emulated_bulk_linear(emu, variant, qtype, n, k, m, ks):
    if m > 16 and variant != "_tb1u4":
        pytest.skip("MT = 4: one tile per warp only")
    qw = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype](n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + ks)).half()
    y = run(emu, x, qw, variant, ks)
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("variant", sorted(CT_TB_KERNELS))
@pytest.mark.parametrize("n,k,ks", [
    (200, 320, 1),     # 5 chunks: the last pair one chunk (its scales' upper half unread), the last slot short
    (48, 1024, 4),     # 16 chunks over 4 warps: 4 each, the ring turning
    (40, 448, 2),      # 7 chunks over 2 warps (3 and 4): an odd tail in one of them
    (16, 3072, 1),     # 48 chunks on one warp: the parity over many turns
])
def test_emulated_bulk_column_trick(emu, variant, n, k, ks):
    """The NVFP4 column-trick kernels fed by bulk copies: M = 1 (warp_m1_bulk), M <= MP = 2, 4, 8 (warp_mp_bulk; also
    below MP, where the kernel re-reads row M - 1 for the columns past M and writes M rows)."""
    qw = nvfp4(n, k, seed=n + k)
    m = {1: ct_tb_m(variant), 2: 1, 4: max(1, ct_tb_m(variant) - 1)}[ks]   # all rows, one, all but one
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(ks)).half()
    y = run(emu, x, qw, variant, ks)
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("n,k,sms", [
    (600, 1024, 2),       # 38 tiles, the last cut short: 2 blocks' warps take 2 tiles each, 6 more one each
    (16 * 40, 512, 2),    # one slot a tile: the ring's phases run across the tiles; 8 tiles in the second wave
    (16 * 16, 1024, 1),   # exactly two tiles per warp: no second wave
])
def test_emulated_seq(emu, n, k, sms):
    """qpn2_linear_m1_seq (NVFP4 M = 1, sm_90+): a first wave whose warps stream two tiles each through one ring, then
    one tile per warp, on the grid qpn.seq_grid gives (one resident block per SM here)."""
    qw = nvfp4(n, k, seed=n + k)
    words, scales = layout.pack_nvfp4(qw)
    b0, grid = seq_grid(-(-n // 16), k // 64, sms, 1)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).half()
    y = torch.full((1, n), float("nan")).half()
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())   # noqa: E731
    nb = lambda t: ctypes.c_long(t.numel() * t.element_size())   # noqa: E731
    emu.emu_seq(ctypes.c_int(grid), ptr(words), nb(words), ptr(scales), nb(scales),
                ctypes.c_float(layout.global_scale(qw)), ptr(x), ptr(y), ctypes.c_int(n), ctypes.c_int(k),
                ctypes.c_int(b0))
    assert not torch.isnan(y).any(), "unwritten outputs"
    ref = x.double() @ qw.dequantize(torch.float64).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"relative error {err:.2e}"

"""Kernels of cuda/fused.cu run on the CPU: the one-token attention (fused_decode_attn, fused_rope_attn,
fused_rope_attn_e, fused_rope_attn_w) and the add + RMSNorm (+ router) kernels (fused_add_rms_norm[_e],
fused_add_norm_router[_e]), their CUDA source compiled as C++ (g++ -std=c++20) under a small shim, a
block's threads as OS threads (__syncthreads and the warp shuffles as barriers), blocks one after another
(the router's also in reverse order), against the torch references and the older kernels. Catches
indexing, masking, split/round/combine, butterfly and ranking errors on a machine without a GPU; timing,
memory ordering between blocks and the real fp16 instructions are checked on a GPU
(tests/test_fused_cuda.py)."""
import ctypes
import re

import pytest
import torch

from hybrid.kernels import fused, fused_build
from hybrid.model.layers import Rotary
from tests.cuda_emu import SHFL_XOR, SHIM, compile_emu

HELPERS = SHFL_XOR + r"""
#include <algorithm>
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline uint32_t warp_xch(uint32_t v, int src) {   // lane src's v (src outside 0..31: 0)
  const int t = threadIdx.x, w = t >> 5;
  xch[t] = v;
  warp_bar[w]->arrive_and_wait();
  const uint32_t r = src >= 0 && src < 32 ? xch[(t & ~31) | src] : 0u;
  warp_bar[w]->arrive_and_wait();
  return r;
}
inline int __shfl_sync(unsigned, int v, int src) { return (int)warp_xch((uint32_t)v, src & 31); }
inline unsigned __ballot_sync(unsigned, int p) {
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= (warp_xch(p != 0, i) ? 1u : 0u) << i;
  return m;
}
inline unsigned __match_any_sync(unsigned, int v) {
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= ((int)warp_xch((uint32_t)v, i) == v ? 1u : 0u) << i;
  return m;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m = std::max(m, warp_xch(v, i));
  return m;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
  unsigned m = 0xffffffffu;
  for (int i = 0; i < 32; ++i) m = std::min(m, warp_xch(v, i));
  return m;
}
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(v); }
inline int atomicAdd(int* p, int v) { const int o = *p; *p += v; return o; }
inline float h2f(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline unsigned short f2h(float f) { _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h; }
inline float ld_cg(const float* p) { return *p; }
inline float4 ld_cg4(const float* p) { return *(const float4*)p; }
inline uint4 ldg_v4(const unsigned short* p) { return *(const uint4*)p; }
"""

ENTRY = r"""
extern "C" void emu_decode_attn(int gx, int gy, const u16* q, const u16* k_store, const u16* v_store,
    const long long* pos, int pos0, u16* out, float* partials, int* counters, int Hkv, int g, int D,
    float scale2, int L, int RK, int R, int cpl) {
  run_grid(gx, gy, ATT_THREADS, [&] { fused_decode_attn(q, k_store, v_store, pos, pos0, out, partials,
                                                        counters, Hkv, g, D, scale2, L, RK, R, cpl); });
}
extern "C" void emu_rope_attn(int gx, int gy, const u16* qkv, const float* q_norm, const float* k_norm,
    const float* table, int table_rows, const long long* pos, int pos0, u16* k_store, u16* v_store,
    u16* out, float* partials, int* counters, int Hq, int Hkv, int D, int C, float eps, float scale2,
    int L, int RK, int R, int cpl) {
  run_grid(gx, gy, ATT_THREADS, [&] { fused_rope_attn(qkv, q_norm, k_norm, table, table_rows, pos, pos0,
      k_store, v_store, out, partials, counters, Hq, Hkv, D, C, eps, scale2, L, RK, R, cpl); });
}
extern "C" void emu_rope_attn_e(int gx, int gy, const u16* qkv, const float* q_norm, const float* k_norm,
    const float* table, int table_rows, const long long* pos, int pos0, u16* k_store, u16* v_store,
    u16* out, float* partials, int* counters, int Hq, int Hkv, int D, int C, float eps, float scale2,
    int L, int RK, int R, int cpl) {
  run_grid(gx, gy, ATT_THREADS, [&] { fused_rope_attn_e(qkv, q_norm, k_norm, table, table_rows, pos, pos0,
      k_store, v_store, out, partials, counters, Hq, Hkv, D, C, eps, scale2, L, RK, R, cpl); });
}
extern "C" void emu_rope_attn_w(int gx, int gy, const u16* qkv, const float* q_norm, const float* k_norm,
    const float* table, int table_rows, const long long* pos, int pos0, u16* k_store, u16* v_store,
    u16* out, float* partials, int* counters, int Hq, int Hkv, int D, int C, float eps, float scale2,
    int L, int RK, int R, int cpl) {
  run_grid(gx, gy, 2 * ATT_THREADS, [&] { fused_rope_attn_w(qkv, q_norm, k_norm, table, table_rows, pos, pos0,
      k_store, v_store, out, partials, counters, Hq, Hkv, D, C, eps, scale2, L, RK, R, cpl); });
}
"""


def _section(src: str, begin: str, end: str | None) -> str:
    a = src.index(begin)
    return src[a: src.index(end, a) if end else len(src)]


def _reductions(src: str) -> str:
    """fused.cu's warp reductions and arrive_last, its acq_rel atomic as the C++ one."""
    found = "".join(re.findall(r"__device__ __forceinline__ (?:float warp_(?:sum|max)\(float v\)|bool arrive_last\([^)]*\)) \{.*?\n\}\n",
                               src, re.S))
    atom = re.compile(r'asm volatile\("atom\.acq_rel\.gpu\.global\.add\.s32 [^\n]*\);$', re.M)
    if len(atom.findall(found)) != 1:
        raise AssertionError("arrive_last: expected one atom.acq_rel.gpu add")
    return atom.sub("old = __atomic_fetch_add(counter, 1, __ATOMIC_ACQ_REL);", found)


def emu_source() -> str:
    """The attention part of cuda/fused.cu (with the RoPE helper and the warp reductions) under SHIM;
    the inline-PTX helpers are the shim's."""
    src = fused_build.source()
    rule = "// " + "-" * 64 + " "
    head = _section(src, "typedef unsigned int u32;", rule)
    reductions = _reductions(src)
    rope = _section(src, rule + "q/k RMSNorm", rule + "router")
    attn = _section(src, rule + "one-token GQA attention", None)
    attn = re.sub(r"__device__ __forceinline__ (uint4 ldg_v4|float4 ld_cg4)\(.*?\n\}\n", "", attn, flags=re.S)
    attn = re.sub(r'asm volatile\("prefetch[^"]*"[^;]*;', ";", attn)          # cache hints: none here
    return SHIM + HELPERS + head + reductions + rope + attn + ENTRY


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "fused_emu", emu_source())


P = lambda t: ctypes.c_void_p(0 if t is None else t.data_ptr())   # noqa: E731
I, F = ctypes.c_int, ctypes.c_float


def _fresh(shape, seed, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift


def _work(hkv, g, d, keys, sms, per_sm=None):
    splits, rounds, rk, cpl = fused.attn_plan(keys, hkv, g, d, sms, per_sm)
    part = torch.full((max(hkv * splits * g * (d + 2), 1),), float("nan"))   # unwritten partials: NaN
    return (splits, rounds, rk, cpl), part, torch.zeros(hkv, dtype=torch.int32)


def emu_decode_attn(lib, q, ks, vs, keys, p, device_pos, sms):
    hq, d = q.shape[-2:]
    hkv = ks.shape[1]
    (splits, rounds, rk, cpl), part, cnt = _work(hkv, hq // hkv, d, keys, sms)
    out = torch.full((1, hq * d), float("nan")).half()
    pos = torch.tensor([p]) if device_pos else None
    lib.emu_decode_attn(I(hkv), I(splits), P(q), P(ks), P(vs), P(pos), I(p), P(out), P(part), P(cnt), I(hkv),
                        I(hq // hkv), I(d), F(d ** -0.5 * fused._LOG2E), I(keys), I(rk), I(rounds), I(cpl))
    assert not cnt.any()                                   # the counters are left zero
    return out


def emu_rope_attn(lib, qkv, qn, kn, table, ks, vs, hq, hkv, d, keys, p, sms, kernel="emu_rope_attn"):
    per_sm = fused.ATT_W_BLOCKS_PER_SM if kernel == "emu_rope_attn_w" else None    # each kernel's own plan
    (splits, rounds, rk, cpl), part, cnt = _work(hkv, hq // hkv, d, keys, sms, per_sm)
    out = torch.full((1, hq * d), float("nan")).half()
    getattr(lib, kernel)(I(hkv), I(splits), P(qkv), P(qn), P(kn), P(table), I(table.shape[0]), P(None), I(p), P(ks),
                      P(vs), P(out), P(part), P(cnt), I(hq), I(hkv), I(d), I(ks.shape[0]), F(1e-6),
                      F(d ** -0.5 * fused._LOG2E), I(keys), I(rk), I(rounds), I(cpl))
    assert not cnt.any()
    return out


SLOW = pytest.mark.slow
CASES = [(32, 4, 128, 31, 132), (32, 4, 128, 32, 132), (32, 4, 128, 300, 16), (4, 2, 64, 5, 132),
         (12, 4, 40, 130, 132), (2, 1, 16, 200, 2), (1, 1, 8, 3, 132), (16, 1, 128, 90, 3), (16, 2, 64, 0, 132),
         (16, 1, 128, 1000, 132),
         pytest.param(32, 4, 128, 300, 132, marks=SLOW), pytest.param(32, 4, 128, 700, 8, marks=SLOW),
         pytest.param(8, 8, 256, 40, 132, marks=SLOW), pytest.param(15, 1, 136, 100, 132, marks=SLOW)]


@pytest.mark.parametrize("hq,hkv,d,p,sms", CASES)
def test_emulated_attention(emu, hq, hkv, d, p, sms):
    """decode_attn at the bucket (splits past the last key) and tight (keys = p + 1), rope_attn at the
    bucket; sms < 132 gives several rounds per split; p = 1000 at 16 / 1 heads: 16 splits with keys (more
    than the combine loads ahead, ATT_PF) and 4 output groups per thread. (OS threads on a small machine: slow; the H200
    shapes with every split are marked slow.)"""
    cap = p + 80
    seed = hq * 1000 + d + p
    q = _fresh((1, hq, d), seed).half()
    ks, vs = _fresh((cap, hkv, d), seed + 1).half(), _fresh((cap, hkv, d), seed + 2).half()
    bucket = min(-(-(p + 1) // 256) * 256, cap)
    qu = torch.empty(hq * d + 1, dtype=torch.float16)[1:].view(1, hq, d).copy_(q)   # not 16-byte aligned
    for keys, device_pos, qq in ((bucket, True, q), (p + 1, False, qu)):
        want = fused.ref_decode_attn(q.float(), ks.float(), vs.float(), keys, start=p)
        got = emu_decode_attn(emu, qq, ks, vs, keys, p, device_pos, sms)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    qkv = _fresh((1, (hq + 2 * hkv) * d), seed + 3).half()
    qn, kn = _fresh((d,), seed + 4, 0.2, 1.0), _fresh((d,), seed + 5, 0.2, 1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), cap)
    rks, rvs = ks.float(), vs.float()
    want = fused.ref_rope_attn(qkv, qn, kn, table, rks, rvs, hq, hkv, d, 1e-6, bucket, start=p)
    outs = []
    kernels = ["emu_rope_attn", "emu_rope_attn_e"]
    if fused.wide_fits(hq // hkv, d):
        kernels.append("emu_rope_attn_w")
    for kernel in kernels:
        ks_k, vs_k = ks.clone(), vs.clone()
        got = emu_rope_attn(emu, qkv, qn, kn, table, ks_k, vs_k, hq, hkv, d, bucket, p, sms, kernel)
        assert not torch.isnan(got).any(), kernel
        torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
        assert torch.equal(vs_k.float(), rvs), kernel
        torch.testing.assert_close(ks_k.float(), rks, atol=2e-3, rtol=1e-3)
        outs.append(got)
    for got in outs[1:]:
        torch.testing.assert_close(got.float(), outs[0].float(), atol=2e-3, rtol=1e-3)   # newer vs old


def test_emulated_bad_position_is_nan(emu):
    q = _fresh((1, 8, 64), 1).half()
    ks, vs = _fresh((300, 2, 64), 2).half(), _fresh((300, 2, 64), 3).half()
    for keys in (16, 256):
        assert torch.isnan(emu_decode_attn(emu, q, ks, vs, keys, -1, True, 132)).all()


def test_emulated_rope_attn_e_bad_position_is_nan(emu):
    """A position outside the table: NaN out and no K/V row written (the older kernel's behaviour)."""
    hq, hkv, d, cap = 8, 2, 64, 300
    qkv = _fresh((1, (hq + 2 * hkv) * d), 7).half()
    qn, kn = _fresh((d,), 8, 0.2, 1.0), _fresh((d,), 9, 0.2, 1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), 100)
    ks, vs = _fresh((cap, hkv, d), 2).half(), _fresh((cap, hkv, d), 3).half()
    ks0, vs0 = ks.clone(), vs.clone()
    for p in (-1, 150):
        for kernel in ("emu_rope_attn_e", "emu_rope_attn_w"):
            got = emu_rope_attn(emu, qkv, qn, kn, table, ks, vs, hq, hkv, d, 256, p, 132, kernel)
            assert torch.isnan(got).all(), kernel
    assert torch.equal(ks, ks0) and torch.equal(vs, vs0)


@pytest.mark.parametrize("min_rounds,p,sms", [(4, 31, 132), (4, 200, 132), (8, 700, 132), (2, 90, 3)])
def test_emulated_rope_attn_e_fewer_splits(emu, monkeypatch, min_rounds, p, sms):
    """fused.ATT_MIN_ROUNDS > 1: fewer splits of more rounds; a lone split with keys writes the output."""
    monkeypatch.setattr(fused, "ATT_MIN_ROUNDS", min_rounds)
    hq, hkv, d = 32, 4, 128
    cap = p + 80
    qkv = _fresh((1, (hq + 2 * hkv) * d), p).half()
    qn, kn = _fresh((d,), p + 1, 0.2, 1.0), _fresh((d,), p + 2, 0.2, 1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), cap)
    ks, vs = _fresh((cap, hkv, d), p + 3).half(), _fresh((cap, hkv, d), p + 4).half()
    keys = min(-(-(p + 1) // 256) * 256, cap)
    rks, rvs = ks.float(), vs.float()
    want = fused.ref_rope_attn(qkv, qn, kn, table, rks, rvs, hq, hkv, d, 1e-6, keys, start=p)
    for kernel in ("emu_rope_attn_e", "emu_rope_attn_w"):
        ks_k, vs_k = ks.clone(), vs.clone()
        got = emu_rope_attn(emu, qkv, qn, kn, table, ks_k, vs_k, hq, hkv, d, keys, p, sms, kernel)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
        assert torch.equal(vs_k.float(), rvs), kernel


# ---------------------------------------------------------------------------- add + RMSNorm + router
ROUTER_ENTRY = r"""
extern "C" void emu_anr(int e_kernel, int reverse, const void* x, const void* delta, const float* w, void* x_out,
    void* hout, int H, float eps, int x_f32, int delta_f32, const float* router, float* logits, int* counter,
    int T, int E, int k, int renorm, long long* ids, float* weights, const int* slot_table, int* slots,
    float* route_row, int S, int* offsets, int* perm, int* active, float* zero, int nzero, int rank) {
  if (e_kernel)
    run_grid(E, 1, 128, [&] { fused_add_norm_router_e(x, delta, w, x_out, hout, H, eps, x_f32, delta_f32, router,
        logits, counter, T, E, k, renorm, ids, weights, slot_table, slots, route_row, S, offsets, perm, active,
        zero, nzero, rank); }, 1, reverse);
  else
    run_grid((E + 3) / 4, 1, 128, [&] { fused_add_norm_router(x, delta, w, x_out, hout, H, eps, x_f32, delta_f32,
        router, logits, counter, T, E, k, renorm, ids, weights, slot_table, slots, route_row); }, 1, reverse);
}
extern "C" void emu_arn(int e_kernel, int T, const void* x, const void* delta, const float* w, void* x_out, void* h,
    float* hf, int H, float eps, int x_f32, int delta_f32) {
  if (e_kernel)
    run_grid(T, 1, 256, [&] { fused_add_rms_norm_e(x, delta, w, x_out, h, hf, H, eps, x_f32, delta_f32); });
  else
    run_grid(T, 1, 256, [&] { fused_add_rms_norm(x, delta, w, x_out, h, hf, H, eps, x_f32, delta_f32); });
}
"""


def router_emu_source() -> str:
    """The residual add + RMSNorm and router parts of cuda/fused.cu under SHIM."""
    src = fused_build.source()
    rule = "// " + "-" * 64 + " "
    head = _section(src, "typedef unsigned int u32;", rule)
    reductions = _reductions(src)
    norm = _section(src, rule + "residual add + RMSNorm", rule + "q/k RMSNorm")
    router = _section(src, rule + "router softmax + top-k", rule + "one-token GQA attention")
    router = re.sub(r'asm volatile\("prefetch[^"]*"[^;]*;', ";", router)      # cache hints: none here
    return SHIM + HELPERS + head + reductions + norm + router + ROUTER_ENTRY


@pytest.fixture(scope="module")
def router_emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "fused_router_emu", router_emu_source())


def emu_add_norm_router(lib, kernel_e, x, w, router, k, delta=None, reverse=False, table=None, plan=None,
                        rank=None, renorm=True):
    """plan (a RoutePlan, block-per-expert kernel only): the MoE routing made too, into its buffers; rank: the last
    block's ranking (fused.ROUTE_RANKS; None = the launcher's default)."""
    t, h = x.shape
    e = router.shape[0]
    x2, hn = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    logits = torch.full((t, e), float("nan"))
    ids, wt = torch.full((t, k), -1, dtype=torch.int64), torch.full((t, k), float("nan"))
    if table is None:
        table = torch.randperm(e, generator=torch.Generator().manual_seed(e)).to(torch.int32)
    slots, row = torch.full((t * k,), -7, dtype=torch.int32), torch.full((t, 2 * k), float("nan"))
    cnt = torch.zeros(1, dtype=torch.int32)
    dt = {torch.float16: 0, torch.float32: 1}
    pl = ((I(plan.slots), P(plan.offsets), P(plan.perm), P(plan.active), P(plan.y), I(t * h)) if plan is not None
          else (I(0), P(None), P(None), P(None), P(None), I(0)))
    lib.emu_anr(I(int(kernel_e)), I(int(reverse)), P(x), P(delta), P(w), P(x2 if delta is not None else None), P(hn),
                I(h), F(1e-6), I(dt[x.dtype]), I(dt[delta.dtype] if delta is not None else 0), P(router), P(logits),
                P(cnt), I(t), I(e), I(k), I(int(renorm)), P(ids), P(wt), P(table), P(slots), P(row), *pl,
                I(fused.ROUTE_RANKS[fused.ROUTE_RANK_DEFAULT] if rank is None else rank))
    assert cnt.item() == 0                                   # the counter is left zero
    assert torch.equal(slots, table[ids.reshape(-1)]) and torch.equal(row[:, k:], wt)
    assert torch.equal(row[:, :k], ids.float())
    return (x2 if delta is not None else x), hn, ids, wt


F16, F32 = torch.float16, torch.float32


@pytest.mark.parametrize("t,h,e,xdt,ddt", [(1, 2048, 128, F16, F16), (3, 100, 60, F32, F16), (2, 4096, 32, F16, F32),
                                           (1, 16, 8, F16, None), (4, 64, 8, F32, F32), (5, 48, 16, F32, None),
                                           (2, 64, 200, F16, F16),      # the softmax's 8 values per lane
                                           pytest.param(8, 256, 512, F16, F16, marks=SLOW)])
def test_emulated_add_norm_router_e(router_emu, t, h, e, xdt, ddt):
    """The block-per-expert kernel against the warp-per-expert one (x2 and h bit-identical, ids identical,
    weights within fp32 rounding) and the torch route of the h it wrote; blocks in reverse order once."""
    k = min(8, e)
    g = torch.Generator().manual_seed(t * 1000 + h + e)
    x = torch.randn(t, h, generator=g).to(xdt)
    d = (torch.randn(t, h, generator=g) * 0.5).to(ddt) if ddt is not None else None
    w = torch.randn(h, generator=g) * 0.2 + 1.0
    router = torch.randn(e, h, generator=g) * 3.0 / h ** 0.5
    old = emu_add_norm_router(router_emu, False, x, w, router, k, d)
    for reverse in (False, True):
        new = emu_add_norm_router(router_emu, True, x, w, router, k, d, reverse)
        assert torch.equal(new[0], old[0])
        torch.testing.assert_close(new[1], old[1], atol=1e-3 if xdt == torch.float16 else 1e-6, rtol=1e-3)
        rid, rw = fused.ref_router_topk(new[1], router, k, True)
        assert torch.equal(new[2], rid)
        torch.testing.assert_close(new[3], rw, atol=1e-6, rtol=1e-5)
        if torch.equal(new[1], old[1]):
            assert torch.equal(new[2], old[2])
            torch.testing.assert_close(new[3], old[3], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("t,k,e,s,absent", [(1, 8, 128, 128, 0.0), (1, 8, 128, 40, 0.3), (4, 8, 64, 64, 0.2),
                                            (4, 8, 128, 1024, 0.0), (3, 4, 16, 5, 0.5), (1, 32, 64, 12, 0.25),
                                            (2, 2, 8, 3, 1.0), (8, 8, 64, 64, 0.0)])
def test_emulated_router_route_plan(router_emu, t, k, e, s, absent):
    """The router kernel's MoE routing (RoutePlan) against ref_route_plan of the slot ids it wrote: offsets of
    every slot with work and the one after, perm of the kept assignments (grouped by slot, ascending, in
    assignment order), active (-1 after), the output zeroed; slots absent (-1) or past S dropped; experts
    sharing a slot (a table with repeats) grouped together; blocks in either order. Past 32 assignments
    (one warp's lanes) the kernel writes no plan."""
    from hybrid.kernels.moe_route import RoutePlan, ref_route_plan

    h = 64
    g = torch.Generator().manual_seed(t * 100 + k + e + s)
    x = torch.randn(t, h, generator=g)
    router = torch.randn(e, h, generator=g)
    table = torch.randint(0, s + 2, (e,), generator=g, dtype=torch.int32)    # repeats; ids s, s + 1 past S
    table[torch.rand(e, generator=g) < absent] = -1
    a = t * k
    for reverse in (False, True):
        i32 = dict(dtype=torch.int32)
        plan = RoutePlan(torch.full((s + 1,), -9, **i32), torch.full((a,), -9, **i32),
                         torch.full((min(a, s),), -9, **i32), torch.full((t, h), float("nan")), s)
        _, _, ids, _ = emu_add_norm_router(router_emu, True, x, torch.ones(h), router, k, None, reverse, table, plan)
        assert torch.equal(plan.y, torch.zeros(t, h))
        if not RoutePlan.fits(t, k):
            assert (plan.offsets == -9).all() and (plan.perm == -9).all() and (plan.active == -9).all()
            continue
        offsets, perm, active = ref_route_plan(table[ids.reshape(-1)], s)
        assert torch.equal(plan.active, active)
        used = [a for a in active.tolist() if a >= 0]
        for slot in used:
            assert plan.offsets[slot].item() == offsets[slot].item()
            assert plan.offsets[slot + 1].item() == offsets[slot + 1].item()
        assert torch.equal(plan.perm[: perm.numel()], perm)


@pytest.mark.parametrize("t,h,e,k,absent,renorm", [(1, 64, 128, 8, 0.0, True), (3, 32, 128, 8, 0.3, True),
                                                    (2, 64, 200, 8, 0.0, True), (1, 32, 256, 6, 0.0, False),
                                                    (2, 32, 512, 8, 0.1, True), (1, 32, 8, 8, 0.0, True),
                                                    (4, 16, 16, 4, 0.5, False), (1, 32, 64, 1, 0.0, True),
                                                    (1, 32, 64, 16, 0.0, True), (1, 32, 40, 2, 0.0, False)])
def test_emulated_route_ranks_agree(router_emu, t, h, e, k, absent, renorm):
    """Both rankings of the router's last block (fused.ROUTE_RANKS: the shuffle rounds on the probabilities, the
    redux.sync rounds on the logits) write the same ids, slots and MoE plan, weights within 2e-6 (no softmax over all
    E in the second), and ref_router_topk's weights, on logits with exact ties (rows repeated in the router) and a
    slot table with absent experts, renormalised or not."""
    from hybrid.kernels.moe_route import RoutePlan

    g = torch.Generator().manual_seed(t * 1000 + e + k)
    x = torch.randn(t, h, generator=g)
    router = torch.randn(e, h, generator=g)
    router[1::3] = router[0::3][: router[1::3].shape[0]]               # equal logits: ties to the lowest id
    table = torch.randperm(e, generator=g).to(torch.int32)
    table[torch.rand(e, generator=g) < absent] = -1
    outs = {}
    for name, rank in fused.ROUTE_RANKS.items():
        i32 = dict(dtype=torch.int32)
        plan = RoutePlan(torch.full((e + 1,), -9, **i32), torch.full((t * k,), -9, **i32),
                         torch.full((min(t * k, e),), -9, **i32), torch.full((t, h), float("nan")), e)
        _, hn, ids, wt = emu_add_norm_router(router_emu, True, x, torch.ones(h), router, k, None, False, table, plan,
                                             rank, renorm)
        outs[name] = (ids, wt, plan.offsets, plan.perm, plan.active)
        _, rw = fused.ref_router_topk(hn, router, k, renorm)        # its ties are in no set order: weights only
        torch.testing.assert_close(wt, rw, atol=1e-6, rtol=1e-5)
        assert all(len(set(r)) == k for r in ids.tolist()) and ids.min() >= 0 and ids.max() < e
    for name, got in outs.items():
        for i, (a, b) in enumerate(zip(got, outs["rounds"])):
            if name == "logits" and i == 1:
                torch.testing.assert_close(a, b, atol=0, rtol=2e-6)
            else:
                assert torch.equal(a, b), name


def test_emulated_topk_ties_take_lowest_ids(router_emu):
    """Equal logits (a zero router): the k lowest ids, in order, as topk_row."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    _, _, ids, wt = emu_add_norm_router(router_emu, True, x, torch.ones(64), torch.zeros(16, 64), 4)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(wt, torch.full((2, 4), 0.25))


@pytest.mark.parametrize("t,h,xdt,ddt", [(1, 2048, F16, F16), (2, 4100, F32, F16), (3, 36, F16, F32), (1, 20480, F16, None),
                                         (2, 5000, F32, F32)])
def test_emulated_add_rms_norm_e(router_emu, t, h, xdt, ddt):
    """The vectorised add + RMSNorm against the older kernel: x2 and the fp32 copy exact / h within one
    rounding (the sum of squares is added in another order)."""
    g = torch.Generator().manual_seed(t * 7 + h)
    x = torch.randn(t, h, generator=g).to(xdt)
    d = (torch.randn(t, h, generator=g) * 0.5).to(ddt) if ddt is not None else None
    w = torch.randn(h, generator=g) * 0.2 + 1.0
    dt = {torch.float16: 0, torch.float32: 1}
    outs = []
    for e_kernel in (0, 1):
        x2, hn, hf = torch.full_like(x, float("nan")), torch.full_like(x, float("nan")), torch.full((t, h), float("nan"))
        router_emu.emu_arn(I(e_kernel), I(t), P(x), P(d), P(w), P(x2 if d is not None else None), P(hn), P(hf), I(h),
                           F(1e-6), I(dt[xdt]), I(dt[ddt] if d is not None else 0))
        assert torch.equal(hf, hn.float())
        outs.append((x2, hn))
    if d is not None:
        assert torch.equal(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-3 if xdt == F16 else 1e-6, rtol=1e-3)


# ---------------------------------------------------------------------------- embedding rows
EMBED_ENTRY = r"""
extern "C" void emu_embed_rows(int T, const void* table, const long long* ids, void* out, int H, long long V,
                               int src, int out_f32) {
  run_grid(T, (H + 255) / 256, 256, [&] { fused_embed_rows(table, ids, out, H, V, src, out_f32); });
}
"""


@pytest.fixture(scope="module")
def embed_emu(tmp_path_factory):
    src = fused_build.source()
    rule = "// " + "-" * 64 + " "
    head = _section(src, "typedef unsigned int u32;", rule)
    rows = _section(src, rule + "embedding rows", rule + "residual add + RMSNorm")
    return compile_emu(tmp_path_factory, "fused_embed_emu", SHIM + HELPERS + head + rows + EMBED_ENTRY)


@pytest.mark.parametrize("src_dt,out_dt,h", [(torch.bfloat16, F16, 2048), (torch.bfloat16, F32, 300), (F16, F16, 5),
                                             (F32, F16, 257), (F32, F32, 64), (F16, F32, 512)])
def test_emulated_embed_rows(embed_emu, src_dt, out_dt, h):
    v = 37
    table = (_fresh((v, h), 11, 3.0) * torch.rand(v, h, generator=torch.Generator().manual_seed(2)) ** 8).to(src_dt)
    table[3, :3] = torch.tensor([70000.0, -1e-7, 65504.0])           # past fp16's range, a subnormal, its largest
    ids = torch.tensor([3, 0, v - 1, 3, 17])
    out = torch.full((ids.numel(), h), float("nan"), dtype=out_dt)
    embed_emu.emu_embed_rows(I(ids.numel()), P(table), P(ids), P(out), I(h), ctypes.c_longlong(v),
                             I(fused._EMB[src_dt]), I(int(out_dt is F32)))
    assert torch.equal(out, fused.ref_embed_rows(table, ids, out_dt))    # bit for bit: one rounding, as torch's


def test_emulated_embed_rows_bad_id_is_nan(embed_emu):
    table = _fresh((8, 40), 3).half()
    ids = torch.tensor([2, 8, -1, 7])
    out = torch.zeros(4, 40, dtype=F16)
    embed_emu.emu_embed_rows(I(4), P(table), P(ids), P(out), I(40), ctypes.c_longlong(8), I(0), I(0))
    assert torch.equal(out[0], table[2]) and torch.equal(out[3], table[7])
    assert out[1:3].isnan().all()

"""The one-token attention kernels of cuda/fused.cu (fused_decode_attn, fused_rope_attn) run on the CPU:
their CUDA source compiled as C++ (g++ -std=c++20) under a small shim, a block's threads as OS threads
(__syncthreads and the warp shuffles as barriers), blocks one after another, against the torch
references. Catches indexing, masking, split/round/combine and butterfly errors on a machine without
a GPU; timing, memory ordering between blocks and the real fp16 instructions are checked on a GPU
(tests/test_fused_cuda.py)."""
import ctypes
import re

import pytest
import torch

from hybrid.kernels import fused, fused_build
from hybrid.model.layers import Rotary
from tests.cuda_emu import SHIM, compile_emu

HELPERS = r"""
static uint32_t xch[1024];
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline uint32_t shfl_bits(uint32_t v, int o) {
  const int t = threadIdx.x, w = t >> 5;
  xch[t] = v;
  warp_bar[w]->arrive_and_wait();
  const uint32_t r = xch[(t & ~31) | ((t & 31) ^ o)];
  warp_bar[w]->arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
  uint32_t b; memcpy(&b, &v, 4); b = shfl_bits(b, o); memcpy(&v, &b, 4); return v;
}
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
"""


def _section(src: str, begin: str, end: str | None) -> str:
    a = src.index(begin)
    return src[a: src.index(end, a) if end else len(src)]


def emu_source() -> str:
    """The attention part of cuda/fused.cu (with the RoPE helper and the warp reductions) under SHIM;
    the inline-PTX helpers are the shim's."""
    src = fused_build.source()
    rule = "// " + "-" * 64 + " "
    head = _section(src, "typedef unsigned int u32;", rule)
    reductions = "".join(re.findall(r"__device__ __forceinline__ float warp_(?:sum|max)\(float v\) \{.*?\n\}\n",
                                    src, re.S))
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


def _work(hkv, g, d, keys, sms):
    splits, rounds, rk, cpl = fused.attn_plan(keys, hkv, g, d, sms)
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


def emu_rope_attn(lib, qkv, qn, kn, table, ks, vs, hq, hkv, d, keys, p, sms):
    (splits, rounds, rk, cpl), part, cnt = _work(hkv, hq // hkv, d, keys, sms)
    out = torch.full((1, hq * d), float("nan")).half()
    lib.emu_rope_attn(I(hkv), I(splits), P(qkv), P(qn), P(kn), P(table), I(table.shape[0]), P(None), I(p), P(ks),
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
    got = emu_rope_attn(emu, qkv, qn, kn, table, ks, vs, hq, hkv, d, bucket, p, sms)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
    assert torch.equal(vs.float(), rvs)
    torch.testing.assert_close(ks.float(), rks, atol=2e-3, rtol=1e-3)


def test_emulated_bad_position_is_nan(emu):
    q = _fresh((1, 8, 64), 1).half()
    ks, vs = _fresh((300, 2, 64), 2).half(), _fresh((300, 2, 64), 3).half()
    for keys in (16, 256):
        assert torch.isnan(emu_decode_attn(emu, q, ks, vs, keys, -1, True, 132)).all()

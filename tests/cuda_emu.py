"""CUDA kernel source run on the CPU for the emulation tests (tests/test_*_emu.py): a shim that compiles a
kernel's source as C++ (g++ -std=c++20), a block's threads as OS threads, __syncthreads/__syncwarp as
barriers, blocks one after another; each test adds the helpers its kernels need (shuffles, inline-PTX
stand-ins) and its extern "C" entry points."""
import ctypes
import re
import shutil
import subprocess

import pytest

SHIM = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;
static std::barrier<>* block_bar;
static std::barrier<>* warp_bar[32];
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __syncthreads() block_bar->arrive_and_wait()
#define __syncwarp() warp_bar[threadIdx.x >> 5]->arrive_and_wait()
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
// threads reused across blocks; blocks in order x fastest, then y, then z (reverse: the opposite order,
// so a kernel's "last block to arrive" logic sees another block last)
template <class F> void run_grid(int gx, int gy, int threads, F f, int gz = 1, bool reverse = false) {
  gridDim.x = gx; gridDim.y = gy; gridDim.z = gz; blockDim.x = threads;
  std::barrier<> bb(threads), between(threads);
  block_bar = &bb;
  for (int w = 0; w < threads / 32; ++w) warp_bar[w] = new std::barrier<>(32);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      threadIdx.x = t;
      for (int o = 0; o < gx * gy * gz; ++o) {
        const int b = reverse ? gx * gy * gz - 1 - o : o;
        blockIdx.x = b % gx; blockIdx.y = b / gx % gy; blockIdx.z = b / (gx * gy);
        f();
        between.arrive_and_wait();                        // the block is done in all its threads
      }
    });
  for (auto& t : ts) t.join();
  for (int w = 0; w < threads / 32; ++w) delete warp_bar[w];
}
"""


# Device helpers both prefill-GEMM emulations (WMMA and gemmf) define alike: weight loads (decode stream and
# GEMM tiles), the split-K counter's atomic, fp16 bits, the exact group-scale decode and multiply, shared addresses.
GEMM_HELPERS = r"""
inline u32x4 ld_stream(const u32x4* p) { return *p; }
inline u64 ld_stream64(const u64* p) { return *p; }
inline u32x4 ld_tile(const u32x4* p) { return *p; }
inline u64 ld_tile64(const u64* p) { return *p; }
inline float ld_part(const float* p) { return *p; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline _Float16 hf(u32 bits) { u16 b = (u16)bits; _Float16 x; memcpy(&x, &b, 2); return x; }
inline u32 hb(_Float16 x) { u16 b; memcpy(&b, &x, 2); return b; }
inline u16 f_to_h(float f) { return (u16)hb((_Float16)f); }
inline u32 dec_scale(u32 w, int odd) {  // (scale * 2^-8) * 2^15 in fp16, round to nearest
  u32 h = (odd ? (w >> 1) : (w << 7)) & 0x3F803F80u;
  return hb((_Float16)((float)hf(h) * 32768.f)) | (hb((_Float16)((float)hf(h >> 16) * 32768.f)) << 16);
}
inline u32 hmul2_splat(u32 a, u32 s, int hi) {
  const float sv = (float)hf(hi ? s >> 16 : s);
  return hb((_Float16)((float)hf(a) * sv)) | (hb((_Float16)((float)hf(a >> 16) * sv)) << 16);
}
// shared addresses: the low 32 bits; every shared array of a kernel lies in one static object
thread_local uintptr_t smem_hi;
inline u32 smem_addr(const void* p) { smem_hi = (uintptr_t)p & ~(uintptr_t)0xFFFFFFFFu; return (u32)(uintptr_t)p; }
inline char* smem_ptr(u32 a) { return (char*)(smem_hi | a); }
"""


def qpn_head(src: str) -> str:
    """cuda/qpn.cu's (src) typedefs and macros: its text from the first typedef up to the loads section."""
    return src[src.index("typedef unsigned int u32;"): src.index("// " + "-" * 64 + " loads, conversions")]


def qpn_preamble(src: str) -> str:
    """The text of cuda/qpn.cu (src) the warp-loop emulations share: qpn_head, BULK_SLOT and the Smem sizes."""
    head = qpn_head(src)
    slot = src[src.index("#define BULK_SLOT"): src.index("\n", src.index("#define BULK_SLOT")) + 1]
    smem = src[src.index("template <int MT, int NT, int ST, int U = 1>\nstruct Smem {"):]
    return head + slot + smem[: smem.index("};\n") + 3]


# __shfl_xor_sync (float and int) for the emulations: a warp's values exchanged through a static array between two warp
# barriers (every lane of the warp must call it, as on the GPU)
SHFL_XOR = r"""
static uint32_t xch[1024];
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
inline int __shfl_xor_sync(unsigned, int v, int o) { return (int)shfl_bits((uint32_t)v, o); }
"""


def mma_shim(name: str) -> str:
    """C++ for `name`(float (&d)[4], a0, a1, a2, a3, b0, b1): mma.sync.m16n8k16.row.col f32.f16.f16.f32 with the PTX
    ISA's fragment layout (g = lane / 4, c = lane % 4): A a0 (g, 2c..2c+1) a1 (g+8, ..) a2 (g, 2c+8..) a3 (g+8,
    2c+8..); B b0 (k 2c..2c+1, n g) b1 (k 2c+8..); D d0 d1 (g, 2c..2c+1), d2 d3 (g+8, 2c..2c+1); the warp's
    fragments exchanged through static arrays between two warp barriers."""
    return r"""
static uint32_t NAME_fa[8][32][4], NAME_fb[8][32][2];
inline float NAME_h(uint32_t bits) { uint16_t b = (uint16_t)bits; _Float16 x; memcpy(&x, &b, 2); return (float)x; }
inline void NAME(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  NAME_fa[w][l][0] = a0, NAME_fa[w][l][1] = a1, NAME_fa[w][l][2] = a2, NAME_fa[w][l][3] = a3;
  NAME_fb[w][l][0] = b0, NAME_fb[w][l][1] = b1;
  warp_bar[w]->arrive_and_wait();
  auto A = [&](int r, int k) {
    const int ln = 4 * (r & 7) + (k & 7) / 2, reg = (r >> 3) + 2 * (k >> 3);
    return NAME_h(NAME_fa[w][ln][reg] >> (16 * (k & 1)));
  };
  auto B = [&](int k, int n) {
    const int ln = 4 * n + (k & 7) / 2;
    return NAME_h(NAME_fb[w][ln][k >> 3] >> (16 * (k & 1)));
  };
  for (int e = 0; e < 4; ++e) {
    const int r = (l >> 2) + 8 * (e >> 1), n = 2 * (l & 3) + (e & 1);
    float s = d[e];
    for (int k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
    d[e] = s;
  }
  warp_bar[w]->arrive_and_wait();
}
""".replace("NAME", name)


_SHARED = re.compile(r"^([ \t]*)__shared__ ((?:__align__\(\d+\) )?)([\w:]+(?: [\w:]+)*?) "
                     r"(\w+(?:\[[^\]]+\])*(?:, \w+(?:\[[^\]]+\])*)*);", re.M)


def poison_shared(source: str) -> str:
    """Every `__shared__` declaration of a kernel source as a static object that thread 0 fills with 0xff bytes
    (NaN floats, -1 integers) at each block's start, then a barrier: a GPU's shared memory holds what earlier
    blocks and kernels left, so what a kernel reads before writing shows in its outputs. The declarations must
    be where every thread of the block passes (a kernel's or an always-called device function's top)."""
    def rewrite(m: re.Match) -> str:
        names = re.findall(r"(\w+)(?:\[[^\]]+\])*", m.group(4))   # brackets may hold commas: Smem<MT, NT, ST>
        fills = " ".join(f"std::memset(&{n}, 0xff, sizeof {n});" for n in names)
        return (f"{m.group(1)}static {m.group(2)}{m.group(3)} {m.group(4)}; "
                f"if (threadIdx.x == 0) {{ {fills} }} __syncthreads();")
    return _SHARED.sub(rewrite, source)


def compile_emu(tmp_path_factory, name: str, source: str) -> ctypes.CDLL:
    """source (SHIM + kernels + entry points) -> the loaded shared library, its shared memory poisoned per block
    (poison_shared); skips without a C++20 g++."""
    if not shutil.which("g++"):
        pytest.skip("needs g++ (C++20)")
    d = tmp_path_factory.mktemp(name)
    (d / "emu.cpp").write_text(poison_shared(source))
    cmd = ["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-o", str(d / "emu.so"), str(d / "emu.cpp"),
           "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode and ("barrier" in res.stderr or "_Float16" in res.stderr):
        pytest.skip("g++ without C++20 <barrier> or _Float16")
    assert res.returncode == 0, res.stderr[-3000:]
    return ctypes.CDLL(str(d / "emu.so"))


def run_gemm_emu(lib, x, qw, tile, splits=1, reverse=False):
    """y[M, N] from an emulated prefill GEMM (`emu_<fmt>_<tile>` in lib: the WMMA GEMM's or gemmf's
    entry points take the same arguments); splits > 1: split-K over that many k ranges (as the launcher
    sizes them: KS = ceil(ceil(K / 64) / splits) k-steps each); blocks run in reverse order if asked.
    Output and split-K scratch start poisoned (NaN)."""
    import torch

    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import layout

    ptr = lambda t: ctypes.c_void_p(t.data_ptr())   # noqa: E731
    i = ctypes.c_int
    n, k = qw.shape
    m = x.shape[0]
    bm, bn = (int(v) for v in tile.split("x"))
    if qw.qtype is QType.NVFP4:
        words, scales = layout.pack_nvfp4(qw)
    else:
        words, scales = layout.pack_fp8(qw), torch.zeros(16, dtype=torch.uint8)
    y = torch.full((m, n), float("nan")).half()
    fmt = 2 if qw.qtype is QType.NVFP4 else 8
    gx, gy, nk = -(-m // bm), -(-n // bn), -(-k // 64)
    ks = -(-nk // splits)
    gz = -(-nk // ks)
    part = torch.full((gz, m, n), float("nan"))
    cnt = torch.zeros(gx * gy, dtype=torch.int32)
    getattr(lib, f"emu_{fmt}_{tile}")(i(gx), i(gy), i(gz), i(int(reverse)), ptr(words), ptr(scales),
                                      ctypes.c_float(layout.global_scale(qw)), ptr(x), ptr(y), i(m), i(n), i(k),
                                      i(ks), ptr(part), ptr(cnt))
    if gz > 1:
        assert (cnt == gz).all(), "every split of every tile must arrive once"
    return y

// QPN prefill GEMM for Hopper (sm_90a): wgmma.mma_async with the decoded weights as the A operand
// from registers and the activations as B from shared memory.
//
// Compiled by NVRTC for sm_90a only (hybrid/kernels/sm90.py); the source includes no header.
// Legend: M activation rows (tokens), N out features, K in features, C packed chunks per 16-row
//         tile (K/64 QPN2, K/32 QPN8), Kp = K rounded up to 64, Mp = M rounded up to NT,
//         NT tokens per block (the wgmma N: 64, 128 or 256), ST ring stages.
//
// y[M, N] = x[M, K] . W[N, K]^T, W packed in the QPN layout of cuda/qpn.cu (its header; the device
// helpers of the "qpn.cu's helpers" line below are qpn.cu's own, put in by sm90.source()),
// never dequantized in memory: decoded in registers straight into wgmma A fragments.
//
// Block: 256 threads = 2 warpgroups, BR = 128 MW weight rows (MW 64-row A sets per warpgroup) x NT
//   tokens. Warp w decodes MW 16-row tiles; in warpgroup w/4 it holds rows 16 (w % 4) .. of each
//   64-row A set, whose register fragment is exactly the mma.m16n8k16 A fragment:
//   lane (g = l/4, q = l%4) holds rows g, g+8 at k-slots 2q, 2q+1, 2q+8, 2q+9; the packed layout
//   gives lane q the elements 16 G + 4 q + 0..3 of group G, so k-slot s of a group holds element
//   perm(s) = 4 (s/2 % 4) + 2 (s/8) + s % 2. B must use the same permutation: the pre-pass
//   qpn_sm90_permute_x writes xp[m, 16 G + s] = x[m, 16 G + perm(s)] (zeros past M and K), laid
//   out as the ring wants it: [Mp / NT][Kp / 64] stage blocks of NT x 128 bytes.
//   Each warpgroup: acc[MW][NT / 2] fp32 per thread = MW x D[64 rows x NT tokens], 4 x MW wgmma
//   m64nNTk16 per 64-k step; A double-buffered in registers (wgmma.wait_group 1 after each commit
//   frees the fragment registers of the group before).
// Shared memory: an ST-slot ring filled by bulk asynchronous copies (cp.async.bulk: the TMA engine,
//   the async proxy that wgmma reads through, so no proxy fence; a cp.async + fence.proxy.async ring
//   measured ~1.5-2 us per 64-k step whatever the tile on the H200, suspected: the fence's
//   MEMBAR.ALL.CTA waits for every copy in flight, so no load overlapped the math),
//   each slot completing on its mbarrier (thread 0 arms it with the stage's bytes). Slot = x stage
//   [NT x 64] in the no-swizzle K-major core-matrix layout (core matrix = 8 tokens x 8 k = 128
//   contiguous bytes; byte offset of (token n, k-octet k8) = (n / 8) 1024 + k8 128 + (n % 8) 16;
//   descriptor LBO = 128 (next k-octet), SBO = 1024 (next 8 tokens)), then per warp and tile the
//   packed words of the step (512 B per chunk, lane l's 16 B at 16 l) and NVFP4 scales (64 B), each
//   copied by lane 0 of its warp. One barrier per 64-k step: after it, stage kt + ST - 2 is issued
//   into the slot of stage kt - 2, whose wgmmas are complete (at most one commit group, of step
//   kt - 1, is pending at the barrier); then each thread waits on stage kt's mbarrier.
// Epilogue: fp32 sums staged in shared memory [NT][BR + 4], rows of 8 outputs written as fp16 x gs
//   (one split) or fp32 partials part[z][M][N] (split-K; the launcher sums them in split order).
// Kernels:
//   qpn_sm90_permute_x           grid (ceil(Mp * Kp / 16 / 256)), 256 threads: x -> xp (stage blocks)
//   qpn{2,8}_wgmma_<BR>x<NT>     BR x NT: 128x64, 128x128, 128x256, 256x64, 256x128; grid (Mp / NT,
//                                ceil(N / BR), splits), 256 threads, dynamic shared memory
//                                sm90.smem_bytes(FMT, BR, NT)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(16) f32x4 { float x, y, z, w; };

#define THREADS 256

// ---------------------------------------------------------------- qpn.cu's helpers
// hybrid.kernels.sm90.source() puts qpn.cu's device functions named on the next line here (shared
// memory addresses and loads, fp16 stores, the register decode of packed words and scales, the
// epilogue's 8-output stores): one copy of each, in qpn.cu.
// QPN_SHARED: smem_addr lds128 lds64 f_to_h dec_fp4 dec_fp8 dec_scale hmul2_splat store_y store_part

// ---------------------------------------------------------------- memory
// bulk asynchronous copy global -> shared (the TMA engine, async proxy), completing on an mbarrier:
// bytes a multiple of 16, both addresses 16-byte aligned
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 mbar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 mbar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mbar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_arrive(u32 mbar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mbar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 mbar, u32 parity) {
  asm volatile("{\n .reg .pred P1;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
               " @P1 bra DONE;\n bra WAIT;\n DONE:\n}" ::"r"(mbar), "r"(parity) : "memory");
}

// ---------------------------------------------------------------- wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// keeps the compiler from moving accumulator accesses across the asynchronous MMAs
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_a(u32 (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
// shared-memory matrix descriptor: no swizzle, LBO 128 (next k-octet), SBO 1024 (next 8 tokens)
__device__ __forceinline__ u64 desc_b(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(1024 >> 4) << 32);
}
// d[64 x N] += a[64 x 16] (this warp's 16 rows in a0..a3) . B[16 x N] (descriptor), fp32 accumulate
__device__ __forceinline__ void wgmma_rs(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[128], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %133, 0;\n wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}

// ---------------------------------------------------------------- pre-pass
// xp fp16 [Mp / NT][Kp / 64][NT x 64 in the slot's core-matrix order]: each 64-k stage of each NT-token
// tile is one contiguous NT x 128-byte block (one bulk copy). One thread per 16-element group (token m,
// group g; m fastest): pairs P0..P7 of x's group (P j = elements 2j, 2j+1) -> k-slots (P0 P2 P4 P6 | P1 P3 P5 P7),
// the two k-octets 2 (g % 4), 2 (g % 4) + 1 of stage g / 4; zeros past M and K.
extern "C" __global__ void __launch_bounds__(THREADS) qpn_sm90_permute_x(
    const u16* __restrict__ x, u16* __restrict__ xp, int M, int K, int Mp, int Kp, int NT) {
  const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
  const int gk = Kp >> 4;
  if (i >= (long long)Mp * gk) return;
  const int m = (int)(i % Mp), g = (int)(i / Mp);  // tokens fastest: 8 threads write one 128-byte k-octet row
  u32x4 a = {0u, 0u, 0u, 0u}, b = {0u, 0u, 0u, 0u};
  if (m < M && 16 * g < K) {
    const u32x4* src = reinterpret_cast<const u32x4*>(x + (size_t)m * K + 16 * g);
    a = src[0], b = src[1];
  }
  const int n = m % NT, k8 = 2 * (g & 3);
  const size_t stage = (size_t)(m / NT) * (Kp >> 6) + (g >> 2);
  u16* blk = xp + stage * NT * 64 + (n >> 3) * 512 + (n & 7) * 8;
  *reinterpret_cast<u32x4*>(blk + k8 * 64) = u32x4{a.x, a.z, b.x, b.z};
  *reinterpret_cast<u32x4*>(blk + (k8 + 1) * 64) = u32x4{a.y, a.w, b.y, b.w};
}

// ---------------------------------------------------------------- GEMM
// MW 64-row A sets per warpgroup (block rows BR = 128 MW): warp w (warpgroup wg = w / 4, wq = w % 4)
// decodes tiles wg 4 MW + 4 u + wq (u < MW), the rows 16 wq .. of its warpgroup's A set u.
template <int FMT, int MW, int NT>
struct Ring {
  static constexpr int CPS = FMT == 2 ? 1 : 2;               // packed chunks per 64-k step
  static constexpr int XS = NT * 128;                        // x bytes per slot
  static constexpr int WS = 8 * MW * CPS * 512;              // packed words per slot: [warp][u][h][lane]
  static constexpr int SS = FMT == 2 ? 8 * MW * 64 : 0;      // NVFP4 scales per slot: [warp][u][row r]
  static constexpr int SLOT = XS + WS + SS;
  __device__ static u32 words(int u, int h) {
    return XS + (((threadIdx.x >> 5) * MW + u) * CPS + h) * 512 + (threadIdx.x & 31) * 16;
  }
  __device__ static u32 scales(int u) { return XS + WS + ((threadIdx.x >> 5) * MW + u) * 64 + (threadIdx.x & 31) / 4 * 8; }
};

// stage kt (k = 64 kt ..) into ring slot sb by bulk copies completing on mbarrier mb: thread 0 arms it
// with the stage's bytes and copies the x block; lane 0 of each warp copies its tiles' words (CPS
// chunks; FP8: one on a last half step) and NVFP4 scales
template <int FMT, int MW, int NT>
__device__ __forceinline__ void load_stage(u32 sb, u32 mb, const u16* __restrict__ xs, const u32x4* const (&wt)[MW],
                                           const u64* const (&st)[MW], int kt, int C) {
  typedef Ring<FMT, MW, NT> R;
  const int chunks = kt * R::CPS + R::CPS <= C ? R::CPS : C - kt * R::CPS;
  const u32 wbytes = chunks * 512, sbytes = FMT == 2 ? 64 : 0;
  if (threadIdx.x == 0) {
    mbar_expect_arrive(mb, R::XS + 8 * MW * (wbytes + sbytes));
    bulk_g2s(sb, xs + (size_t)kt * NT * 64, R::XS, mb);
  }
  if ((threadIdx.x & 31) == 0) {
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int u = 0; u < MW; ++u) {
      bulk_g2s(sb + R::XS + (warp * MW + u) * R::CPS * 512, wt[u] + (size_t)kt * R::CPS * 32, wbytes, mb);
      if (FMT == 2) bulk_g2s(sb + R::XS + R::WS + (warp * MW + u) * 64, st[u] + (size_t)kt * 8, sbytes, mb);
    }
  }
}

// warp-specialized (WS): the producer warp's copies of stage kt into slot sb, completing on full:
// lane 0 arms it, then copy i = lane, lane + 32, .. of x (i = 0), the 8 MW tiles' words (1 .. 8 MW)
// and NVFP4 scales (8 MW + 1 .. 16 MW); tiles past N read the last tile
template <int FMT, int MW, int NT>
__device__ __forceinline__ void produce_stage(u32 sb, u32 full, const u16* __restrict__ xs, const u32x4* __restrict__ w,
                                              const u64* __restrict__ s, int t0, int tiles, int kt, int C) {
  typedef Ring<FMT, MW, NT> R;
  const int lane = threadIdx.x & 31;
  const int chunks = kt * R::CPS + R::CPS <= C ? R::CPS : C - kt * R::CPS;
  const u32 wbytes = chunks * 512, sbytes = FMT == 2 ? 64 : 0;
  if (lane == 0) mbar_expect_arrive(full, R::XS + 8 * MW * (wbytes + sbytes));
  __syncwarp();
  constexpr int NC = 1 + (FMT == 2 ? 16 : 8) * MW;
#pragma unroll
  for (int i = lane; i < NC; i += 32) {
    if (i == 0) {
      bulk_g2s(sb, xs + (size_t)kt * NT * 64, R::XS, full);
    } else {
      const int c = (i - 1) % (8 * MW), wq = c / MW, u = c % MW;   // warp wq's tile u
      int t = t0 + (wq >> 2) * 4 * MW + 4 * u + (wq & 3);
      if (t >= tiles) t = tiles - 1;
      if (i <= 8 * MW)
        bulk_g2s(sb + R::XS + c * R::CPS * 512, w + ((size_t)t * C + kt * R::CPS) * 32, wbytes, full);
      else
        bulk_g2s(sb + R::XS + R::WS + c * 64, s + ((size_t)t * C + kt) * 8, sbytes, full);
    }
  }
}

__device__ __forceinline__ void mbar_arrive(u32 mbar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mbar) : "memory");
}
// the consumer warps' own barrier (the producer warp never joins)
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// A fragment of group j (0..3) of a 64-k step: a[0..3] = rows (r, r+8) x k-slots (lo, hi)
template <int FMT>
__device__ __forceinline__ void decode_a(u32 (&a)[4], const u32x4 (&wv)[2], u64 sv, int j) {
  if (FMT == 2) {
    const u32 s2 = dec_scale((u32)(sv >> (32 * (j >> 1))), j & 1);
    const u32 w = j == 0 ? wv[0].x : j == 1 ? wv[0].y : j == 2 ? wv[0].z : wv[0].w;
    u32 p0, p1, p2, p3;
    dec_fp4(w, p0, p1, p2, p3);
    a[0] = hmul2_splat(p0, s2, 0), a[1] = hmul2_splat(p1, s2, 1);
    a[2] = hmul2_splat(p2, s2, 0), a[3] = hmul2_splat(p3, s2, 1);
  } else {  // chunk j / 2: words (g0, r) (g0, r+8) (g1, r) (g1, r+8)
    const u32x4& v = wv[j >> 1];
    dec_fp8((j & 1) ? v.z : v.x, a[0], a[2]);
    dec_fp8((j & 1) ? v.w : v.y, a[1], a[3]);
  }
}

// the mbarriers (ST full, then WS: ST empty) sit past the ring and the epilogue's staging
template <int FMT, int MW, int NT, int ST>
__device__ __host__ constexpr int mbar_offset() {
  return ((ST * Ring<FMT, MW, NT>::SLOT > NT * (128 * MW + 4) * 4 ? ST * Ring<FMT, MW, NT>::SLOT
                                                                   : NT * (128 * MW + 4) * 4) + 7) & ~7;
}

template <int FMT, int MW, int NT, int ST, int PS, int NOLD = 0, int WS = 0>
__device__ __forceinline__ void wgmma_body(const u32x4* __restrict__ w, const u64* __restrict__ s, float gs,
                                           const u16* __restrict__ xp, u16* __restrict__ y,
                                           float* __restrict__ part, int M, int N, int K, int Kp, int KS) {
  typedef Ring<FMT, MW, NT> R;
  constexpr int NR = NT / 2, BR = 128 * MW, SW = BR + 4;  // accumulators per set; staged row (floats)
  static_assert(ST >= 3 && NT * 8 % THREADS == 0, "wgmma shape");
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = blockIdx.x * NT, n0 = blockIdx.y * BR;
  const int C = K / (FMT == 2 ? 64 : 32), tiles = (N + 15) >> 4, nk = Kp >> 6;
  const int kb = blockIdx.z * KS, ke = kb + KS < nk ? kb + KS : nk;
  int tt[MW];  // this warp's tiles within the block
  const u32x4* wt[MW];
  const u64* st[MW];
#pragma unroll
  for (int u = 0; u < MW; ++u) {
    tt[u] = (warp >> 2) * 4 * MW + 4 * u + (warp & 3);
    int t = (n0 >> 4) + tt[u];
    if (t >= tiles) t = tiles - 1;  // rows past N: read a valid tile, never written
    wt[u] = w + (size_t)t * C * 32;
    st[u] = s + (size_t)t * C * 8;
  }
  const u16* xs = xp + (size_t)blockIdx.x * nk * NT * 64;  // this token tile's stages
  const u32 ring = smem_addr(smem), mbar = ring + mbar_offset<FMT, MW, NT, ST>();
  if (tid == 0) {
#pragma unroll
    for (int p = 0; p < ST; ++p) {
      mbar_init(mbar + 8 * p, 1);
      if (WS) mbar_init(mbar + 8 * (ST + p), 8);   // empty: one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (WS && warp >= 8) {  // the producer warpgroup gives its registers to the consumers; its first warp
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");  // stages kt into slot (kt - kb) % ST
    if (warp == 8) {                                                   // once its last use is released
      u32 ph = 0;
      for (int kt = kb, slot = 0; kt < ke; ++kt) {
        if (kt - kb >= ST) mbar_wait(mbar + 8 * (ST + slot), ph ^ 1u);
        produce_stage<FMT, MW, NT>(ring + slot * R::SLOT, mbar + 8 * slot, xs, w, s, n0 >> 4, tiles, kt, C);
        if (slot == ST - 1) slot = 0, ph ^= 1u;
        else ++slot;
      }
    }
    return;
  }
  if (WS) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  float acc[MW][NR];
#pragma unroll
  for (int u = 0; u < MW; ++u)
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[u][i] = 0.f;
  if (!WS) {
#pragma unroll
    for (int p = 0; p < ST - 2; ++p)
      if (kb + p < ke) load_stage<FMT, MW, NT>(ring + p * R::SLOT, mbar + 8 * p, xs, wt, st, kb + p, C);
  }
  if (NOLD) {  // diagnostic (timing only, wrong results): the loop multiplies the first stages again
#pragma unroll
    for (int p = 0; p < ST - 2; ++p)
      if (kb + p < ke) mbar_wait(mbar + 8 * p, 0);
  }
  int slot = 0;
  u32 phase = 0;  // parity of the slot's current use
  // one 64-k step; ab: A fragment buffers [NB][MW][4] (group j uses ab[j % NB])
  auto step = [&](int kt, auto& ab) {
    constexpr int NB = sizeof(ab) / sizeof(ab[0]);
    if (WS) {
      mbar_wait(mbar + 8 * slot, phase);  // stage kt has landed
    } else {
      __syncthreads();  // every warpgroup's wgmmas (and every lane's reads) of step kt - 2 are done
      if (!NOLD) {
        const int nx = kt + ST - 2, ns = slot >= 2 ? slot - 2 : slot + ST - 2;
        if (nx < ke) load_stage<FMT, MW, NT>(ring + ns * R::SLOT, mbar + 8 * ns, xs, wt, st, nx, C);
        mbar_wait(mbar + 8 * slot, phase);  // stage kt has landed
      }
    }
    const u32 sb = ring + slot * R::SLOT;
    // groups of 16 k of this step inside K (FP8: 2 on a last half step). ptxas (12.9) serializes the
    // wgmmas (C7513) of the per-step pipeline when its step is straight-line code (NVFP4) unless the
    // count is a run-time value, and of the per-group pipeline when it is: each form keeps its own
    // (the compile-only check fails on C7513).
    const int ng = PS ? (K - 64 * kt >= 64 ? 4 : (K - 64 * kt) >> 4) : (FMT == 8 && 2 * kt + 1 >= C ? 2 : 4);
    u32x4 wv[MW][2];
    u64 sv[MW];
#pragma unroll
    for (int u = 0; u < MW; ++u) {
      wv[u][0] = lds128(sb + R::words(u, 0));
      wv[u][1] = R::CPS == 2 ? lds128(sb + R::words(u, 1)) : wv[u][0];
      sv[u] = FMT == 2 ? lds64(sb + R::scales(u)) : 0ull;
    }
#pragma unroll
    for (int u = 0; u < MW; ++u) fence_acc<NR>(acc[u]);
    if (PS) {  // the whole step's fragments, then its wgmmas as one group
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int u = 0; u < MW; ++u) {
          decode_a<FMT>(ab[j][u], wv[u], sv[u], j);
          fence_a(ab[j][u]);  // computed before the fence, not sunk between the wgmmas
        }
      u64 d[4];  // the groups' B descriptors, likewise
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        d[j] = desc_b(sb + 256 * j);
        asm volatile("" : "+l"(d[j])::"memory");
      }
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j == ng) break;
#pragma unroll
        for (int u = 0; u < MW; ++u)
          wgmma_rs(acc[u], ab[j][u][0], ab[j][u][1], ab[j][u][2], ab[j][u][3], d[j]);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the step before is done: its A registers are free
    } else {   // per group: decode, wgmma, commit, wait for the group before
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (FMT == 8 && j == 2 && ng == 2) break;
#pragma unroll
        for (int u = 0; u < MW; ++u) {
          decode_a<FMT>(ab[j % NB][u], wv[u], sv[u], j);
          fence_a(ab[j % NB][u]);
        }
        u64 d = desc_b(sb + 256 * j);
        asm volatile("" : "+l"(d)::"memory");
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < MW; ++u)
          wgmma_rs(acc[u], ab[j % NB][u][0], ab[j % NB][u][1], ab[j % NB][u][2], ab[j % NB][u][3], d);
        wgmma_commit();
        wgmma_wait<1>();  // the group before this one is done: its A registers are free
      }
    }
#pragma unroll
    for (int u = 0; u < MW; ++u) fence_acc<NR>(acc[u]);
    if (WS && kt > kb) {  // step kt - 1's wgmmas are complete (one group pending): release its slot
      __syncwarp();
      if (lane == 0) mbar_arrive(mbar + 8 * (ST + (slot == 0 ? ST - 1 : slot - 1)));
    }
    if (NOLD) slot = slot == ST - 3 ? 0 : slot + 1;   // the prologue's ST - 2 stages, round and round
    else if (slot == ST - 1) slot = 0, phase ^= 1u;
    else ++slot;
  };
  if (PS) {  // two buffer sets, alternating steps
    u32 a0[4][MW][4], a1[4][MW][4];
    for (int kt = kb; kt < ke; kt += 2) {
      step(kt, a0);
      if (kt + 1 < ke) step(kt + 1, a1);
    }
  } else {
    u32 a[2][MW][4];
    for (int kt = kb; kt < ke; ++kt) step(kt, a);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int u = 0; u < MW; ++u) fence_acc<NR>(acc[u]);
  if (WS) consumers_sync();
  else __syncthreads();  // the ring (every stage consumed) becomes the epilogue's staging area [NT][SW] fp32
  // acc[u][4 i + 2 v1 + v0]: block row 16 tt[u] + l / 4 + 8 v1, token 8 i + 2 (l % 4) + v0
  float* stg = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int u = 0; u < MW; ++u) {
#pragma unroll
    for (int i = 0; i < NT / 8; ++i) {
      float* r0 = stg + (8 * i + 2 * q) * SW + 16 * tt[u] + g;
      r0[0] = acc[u][4 * i], r0[SW] = acc[u][4 * i + 1], r0[8] = acc[u][4 * i + 2], r0[SW + 8] = acc[u][4 * i + 3];
    }
  }
  if (WS) consumers_sync();
  else __syncthreads();
  const size_t zoff = (size_t)blockIdx.z * M * N;
#pragma unroll 4
  for (int p = tid; p < NT * (BR / 8); p += THREADS) {
    const int r = p / (BR / 8), c8 = 8 * (p % (BR / 8)), m = m0 + r, n = n0 + c8;
    if (m < M && n < N) {
      const f32x4 lo = *reinterpret_cast<const f32x4*>(stg + r * SW + c8);
      const f32x4 hi = *reinterpret_cast<const f32x4*>(stg + r * SW + c8 + 4);
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      if (part)
        store_part(part + zoff + (size_t)m * N + n, v, n, N);
      else
        store_y(y + (size_t)m * N + n, v, gs, n, N);
    }
  }
}

// qpn{2,8}_wgmma_<BR>x<NT>: w words [Tn, C, 32, 4] (as u32x4), s scales [Tn, C, 8, 8] (as u64; FP8:
// any 16 bytes), gs the folded global scale, xp [Mp, Kp] (qpn_sm90_permute_x), y [M, N] fp16 (one
// split) or part fp32 [splits, M, N] (non-null: split-K partials, unscaled), KS 64-k steps per
// split. BR weight rows x NT tokens per block; ST ring stages; MINB blocks per SM (registers and
// shared memory of that many fit).
#define WGMMA1(FMT, BR, NT, ST, MINB, PS, SFX)                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) qpn##FMT##_wgmma_##BR##x##NT##SFX(    \
      const u32x4* __restrict__ w, const u64* __restrict__ s, float gs, const u16* __restrict__ xp, \
      u16* __restrict__ y, float* __restrict__ part, int M, int N, int K, int Kp, int KS) {         \
    wgmma_body<FMT, BR / 128, NT, ST, PS>(w, s, gs, xp, y, part, M, N, K, Kp, KS);                 \
  }
// each tile in two pipelines: per group (decode, wgmma, wait for the group before) and, suffix _s,
// per step (the step's 4 fragments decoded, its wgmmas one group; two register sets)
// warp-specialized, suffix _w: a third (producer) warpgroup, 40 registers (setmaxnreg), one warp of
// which fills the ring on empty/full mbarriers; the consumer warpgroups (232 registers) never wait for
// each other (blockDim 384, one block per SM)
#define WGMMA_WS(FMT, BR, NT, ST, MINB, PS, SFX)                                                   \
  extern "C" __global__ void __launch_bounds__(THREADS + 128, 1) qpn##FMT##_wgmma_##BR##x##NT##SFX(   \
      const u32x4* __restrict__ w, const u64* __restrict__ s, float gs, const u16* __restrict__ xp, \
      u16* __restrict__ y, float* __restrict__ part, int M, int N, int K, int Kp, int KS) {         \
    wgmma_body<FMT, BR / 128, NT, ST, PS, 0, 1>(w, s, gs, xp, y, part, M, N, K, Kp, KS);           \
  }
// STW: the warp-specialized kernel's ring stages (one block per SM: as many as shared memory holds, <= 12)
#define WGMMA(FMT, BR, NT, ST, MINB, STW) WGMMA1(FMT, BR, NT, ST, MINB, 0, ) WGMMA1(FMT, BR, NT, ST, MINB, 1, _s) \
  WGMMA_WS(FMT, BR, NT, STW, 1, 0, _w)
// diagnostics (timing only, results wrong): no loads in the main loop (the decode + wgmma rate alone)
#define WGMMA_NOLD(FMT, BR, NT, ST, MINB, PS, SFX)                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) qpn##FMT##_wgmma_##BR##x##NT##SFX##_nold( \
      const u32x4* __restrict__ w, const u64* __restrict__ s, float gs, const u16* __restrict__ xp, \
      u16* __restrict__ y, float* __restrict__ part, int M, int N, int K, int Kp, int KS) {         \
    wgmma_body<FMT, BR / 128, NT, ST, PS, 1>(w, s, gs, xp, y, part, M, N, K, Kp, KS);              \
  }
WGMMA(2, 128, 64, 8, 2, 12)
WGMMA(2, 128, 128, 5, 2, 10)
WGMMA(2, 128, 256, 6, 1, 6)
WGMMA(2, 256, 64, 6, 2, 12)
WGMMA(2, 256, 128, 8, 1, 9)
WGMMA(8, 128, 64, 6, 2, 12)
WGMMA(8, 128, 128, 4, 2, 9)
WGMMA(8, 128, 256, 5, 1, 5)
WGMMA(8, 256, 64, 4, 2, 9)
WGMMA(8, 256, 128, 6, 1, 7)
WGMMA_NOLD(2, 128, 256, 6, 1, 0, )
WGMMA_NOLD(2, 128, 256, 6, 1, 1, _s)
WGMMA_NOLD(2, 256, 128, 8, 1, 0, )
WGMMA_NOLD(2, 256, 128, 8, 1, 1, _s)

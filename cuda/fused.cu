// Fused small kernels of the decode step: each one replaces several torch ops (and launches) per
// layer beside the QPN GEMVs. Same conventions as qpn.cu: compiled at run time by NVRTC for the
// device's architecture, no header, launched on torch's current stream (CUDA-graph capturable).
// Volta-legal (sm_70): fp32 math, fp16 only as storage (cvt.f32.f16 / cvt.rn.f16.f32), no cp.async.
//
// Legend: T tokens, H hidden, Hq / Hkv query / KV heads, D head_dim, E experts, k experts per token,
//         R rows of the RoPE table, C rows of the KV store, L keys attended.
// dtype codes (arguments named *_f32): 0 fp16, 1 fp32. Math is fp32 and every result is rounded once,
// as the torch ops these replace do (x + delta rounds to x's dtype; rms_norm casts at the end).
//
// Kernels:
//   fused_add_rms_norm  grid T, block 256
//       x [T, H] (fp16 | fp32), delta [T, H] (fp16 | fp32) or null, w [H] fp32
//       x_out [T, H] x's dtype = x + delta.to(x.dtype)           (written only when delta is given)
//       h [T, H] x's dtype     = rms_norm(x_out) * w              (fp32 math, one rounding)
//       hf [T, H] fp32         = float(h) or null                 (the router's fp32 input)
//   fused_qk_rope_kv    grid ceil(T * (Hq + 2 Hkv) / 4), block 128: one warp per (token, head)
//       qkv [T, (Hq + 2 Hkv) * D] fp16 (q heads, k heads, v heads), q_norm / k_norm [D] fp32 or null,
//       table [R, 2, D] fp32 (cos, signed sin: Rotary.table), position p = (*pos or pos0) + t
//       q [T, Hq, D] fp16 = rope(rms_norm(q) * q_norm); k_store[p] = rope(rms_norm(k) * k_norm),
//       v_store[p] = v (k_store / v_store [C, Hkv, D] fp16). A position outside the table or the
//       store writes no K/V and NaN into q, so a bad device position cannot pass unnoticed.
//   fused_route_topk    grid ceil(T / 4), block 128: one warp per token, E <= 512, k <= 32
//       logits [T, E] fp32 -> softmax -> top-k (descending, ties to the lowest id) -> optional
//       renormalisation: ids [T, k] int64, weights [T, k] fp32; optionally (each pointer may be null)
//       slots [T * k] int32 = slot_table[ids] (slot_table [E] int32: the runtime's expert -> slot map)
//       and route_row [T, 2k] fp32 = (ids as floats, weights) (the runtime's route buffer row)
//   fused_router_topk   grid ceil(E / 4), block 128: the router GEMV as well, T <= 8 tokens
//       h [T, H] (fp16 | fp32), router [E, H] fp32 -> logits [T, E] fp32 (= h . router^T), then as
//       fused_route_topk; counter [1] int (zero, and left zero by the last block, which routes)
//   fused_add_norm_router  grid ceil(E / 4), block 128, T <= 8: fused_add_rms_norm (x_out, h) and
//       fused_router_topk on that h in one launch (logits [T, E] fp32 scratch, counter as above)
//   fused_decode_attn   grid (Hkv, S splits), block 128: one query token, GQA (g = Hq / Hkv);
//       S = ceil(L / SK) for the L rows the launch covers (a graph's bucket, L > p), split s takes
//       keys [SK s, SK s + SK), SK = 64 or 128; g <= 16, g * D <= 2048, D % 8 == 0, D <= 256
//       q [Hq, D] fp16, k_store / v_store [C, Hkv, D] fp16, keys 0..p attended (p = *pos or pos0)
//       -> out [Hq, D] fp16; partials [Hkv, S, g, D + 2] fp32 and counters [Hkv] int (zero, and left
//       zero: the last split block of a head combines the partials and resets its counter)
//   fused_rope_attn     grid (Hkv, S splits), block 128, one token: fused_qk_rope_kv + fused_decode_attn
//       in one launch: qkv [1, (Hq + 2 Hkv) * D] fp16 -> out [Hq, D] fp16, K/V row p written by the
//       block whose split holds p (so L > p is required), the queries made by every block

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------- conversions, reductions
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float ld_cg(const float* p) {   // L2, not a possibly stale L1 line
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// ---------------------------------------------------------------- residual add + RMSNorm
// The dtypes are template parameters of the loop bodies (XF: x fp32; DM: 0 no delta, 1 fp16, 2 fp32
// delta), picked once per launch: loops without branches keep several loads in flight.
template <bool XF, int DM>
__device__ __forceinline__ float resid(const void* x, const void* delta, size_t i) {
  float v = XF ? ((const float*)x)[i] : h2f(((const u16*)x)[i]);
  if (DM) {
    float d = DM == 2 ? ((const float*)delta)[i] : h2f(((const u16*)delta)[i]);
    if (!XF) d = h2f(f2h(d));                              // delta.to(x.dtype)
    v = XF ? v + d : h2f(f2h(v + d));                      // x + that, rounded to x's dtype
  }
  return v;
}
template <bool XF>
__device__ __forceinline__ void store_x(void* p, size_t i, float v) {
  if (XF) ((float*)p)[i] = v;
  else ((u16*)p)[i] = f2h(v);
}
template <bool XF>
__device__ __forceinline__ float round_x(float v) { return XF ? v : h2f(f2h(v)); }

// Dispatch a body template on (x_f32, delta given, delta_f32).
#define DISPATCH_XD(BODY, ...)                                                          \
  do {                                                                                  \
    if (x_f32) {                                                                        \
      if (!delta) BODY<true, 0>(__VA_ARGS__);                                           \
      else if (delta_f32) BODY<true, 2>(__VA_ARGS__);                                   \
      else BODY<true, 1>(__VA_ARGS__);                                                  \
    } else {                                                                            \
      if (!delta) BODY<false, 0>(__VA_ARGS__);                                          \
      else if (delta_f32) BODY<false, 2>(__VA_ARGS__);                                  \
      else BODY<false, 1>(__VA_ARGS__);                                                 \
    }                                                                                   \
  } while (0)

template <bool XF, int DM>
__device__ __forceinline__ void add_rms_norm_body(const void* x, const void* delta, const float* w,
                                                  void* x_out, void* h, float* hf, int H, float eps,
                                                  float* part) {
  const size_t row = (size_t)blockIdx.x * H;
  const int tid = threadIdx.x;
  float ss = 0.f;
#pragma unroll 4
  for (int i = tid; i < H; i += 256) {
    const float s = resid<XF, DM>(x, delta, row + i);
    if (DM) store_x<XF>(x_out, row + i, s);
    ss = fmaf(s, s, ss);
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) part[tid >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) tot += part[j];
  const float rstd = rsqrtf(tot / (float)H + eps);
#pragma unroll 4
  for (int i = tid; i < H; i += 256) {                   // x_out again, recomputed (not re-read)
    const float v = round_x<XF>(resid<XF, DM>(x, delta, row + i) * rstd * w[i]);
    store_x<XF>(h, row + i, v);
    if (hf) hf[row + i] = v;
  }
}

extern "C" __global__ void __launch_bounds__(256)
    fused_add_rms_norm(const void* x, const void* delta, const float* w, void* x_out, void* h,
                       float* hf, int H, float eps, int x_f32, int delta_f32) {
  __shared__ float part[8];
  DISPATCH_XD(add_rms_norm_body, x, delta, w, x_out, h, hf, H, eps, part);
}

// ---------------------------------------------------------------- q/k RMSNorm + RoPE + KV write
#define ROPE_MAXR 4   // pairs (i, i + D/2) per lane: D <= 256

// One warp, one head: src [D] fp16 -> RMSNorm (when nw) * nw -> RoPE with cs = (cos [D], signed
// sin [D]) -> fp16 into gdst, or (TO_SMEM) the fp16-rounded values as floats into sdst.
// ok == false: NaN (a position outside the table or the store).
template <bool TO_SMEM>
__device__ __forceinline__ void rope_head(const u16* src, const float* nw, const float* cs, int D,
                                          float eps, bool ok, u16* gdst, float* sdst) {
  const int lane = threadIdx.x & 31, half = D >> 1;
  float a[ROPE_MAXR], b[ROPE_MAXR];                       // elements i and i + half, i = lane + 32 r
  float na[ROPE_MAXR], nb[ROPE_MAXR], c[4][ROPE_MAXR];    // their norm weights, cos and signed sin
#pragma unroll
  for (int r = 0; r < ROPE_MAXR; ++r) {                   // every load first: one latency, not three
    const int i = lane + 32 * r;
    a[r] = b[r] = na[r] = nb[r] = c[0][r] = c[1][r] = c[2][r] = c[3][r] = 0.f;
    if (i < half) {
      a[r] = h2f(src[i]);
      b[r] = h2f(src[i + half]);
      if (nw) {
        na[r] = nw[i];
        nb[r] = nw[i + half];
      }
      c[0][r] = cs[i];
      c[1][r] = cs[i + half];
      c[2][r] = cs[D + i];
      c[3][r] = cs[D + i + half];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int r = 0; r < ROPE_MAXR; ++r) ss = fmaf(b[r], b[r], fmaf(a[r], a[r], ss));   // explicit FMAs
  if (nw) {
    const float rstd = rsqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
    for (int r = 0; r < ROPE_MAXR; ++r) {
      a[r] = a[r] * rstd * na[r];
      b[r] = b[r] * rstd * nb[r];
    }
  }
#pragma unroll
  for (int r = 0; r < ROPE_MAXR; ++r) {
    const int i = lane + 32 * r;
    if (i < half) {
      float oa = fmaf(b[r], c[2][r], a[r] * c[0][r]);
      float ob = fmaf(a[r], c[3][r], b[r] * c[1][r]);
      if (!ok) oa = ob = __int_as_float(0x7fc00000);
      if (TO_SMEM) {
        sdst[i] = h2f(f2h(oa));
        sdst[i + half] = h2f(f2h(ob));
      } else {
        gdst[i] = f2h(oa);
        gdst[i + half] = f2h(ob);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(128)
    fused_qk_rope_kv(const u16* qkv, const float* q_norm, const float* k_norm, const float* table,
                     int table_rows, const long long* pos, int pos0, u16* q_out, u16* k_store,
                     u16* v_store, int T, int Hq, int Hkv, int D, int C, float eps) {
  const int heads = Hq + 2 * Hkv;
  const int gw = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (gw >= T * heads) return;
  const int t = gw / heads, hh = gw - t * heads;
  const long long p = (pos ? pos[0] : (long long)pos0) + t;
  const bool ok = p >= 0 && p < C && p < table_rows;
  const u16* src = qkv + ((size_t)t * heads + hh) * D;
  if (hh >= Hq + Hkv) {                                   // v head: copy into the store
    if (!ok) return;
    u16* dst = v_store + ((size_t)p * Hkv + (hh - Hq - Hkv)) * D;
    for (int i = lane; i < D; i += 32) dst[i] = src[i];
    return;
  }
  if (!ok && hh >= Hq) return;                            // no K row for a bad position
  u16* dst = hh < Hq ? q_out + ((size_t)t * Hq + hh) * D : k_store + ((size_t)p * Hkv + (hh - Hq)) * D;
  rope_head<false>(src, hh < Hq ? q_norm : k_norm, table + (size_t)(ok ? p : 0) * 2 * D, D, eps, ok,
                   dst, nullptr);
}

// ---------------------------------------------------------------- router softmax + top-k
#define ROUTE_MAXV 16   // experts per lane: E <= 512
#define ROUTER_MAXT 8   // tokens of fused_router_topk

// One warp: softmax over row[0..E), top-k (descending, ties to the lowest id), optional renorm;
// lane r < k writes the r-th choice of token t (and the runtime's slot id and route row).
__device__ __forceinline__ void topk_row(const float* row, bool l2, int t, int E, int k, int renorm,
                                         long long* ids, float* weights, const int* slot_table,
                                         int* slots, float* route_row) {
  const int lane = threadIdx.x & 31;
  float v[ROUTE_MAXV];
  float m = NEG_INF;
#pragma unroll
  for (int j = 0; j < ROUTE_MAXV; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? (l2 ? ld_cg(row + e) : row[e]) : NEG_INF;
    m = fmaxf(m, v[j]);
  }
  m = warp_max(m);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < ROUTE_MAXV; ++j) {
    v[j] = lane + 32 * j < E ? expf(v[j] - m) : 0.f;
    s += v[j];
  }
  s = warp_sum(s);
#pragma unroll
  for (int j = 0; j < ROUTE_MAXV; ++j) v[j] = lane + 32 * j < E ? v[j] / s : -1.f;  // probs >= 0
  float mine_w = 0.f, total = 0.f;
  int mine_id = 0;
  for (int r = 0; r < k; ++r) {
    float best = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < ROUTE_MAXV; ++j)
      if (v[j] > best) { best = v[j]; bi = lane + 32 * j; }   // ascending ids: keeps the lowest
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
    }
#pragma unroll
    for (int j = 0; j < ROUTE_MAXV; ++j)
      if (lane + 32 * j == bi) v[j] = -2.f;                  // taken
    if (lane == r) { mine_w = best; mine_id = bi; }
    total += best;
  }
  if (lane < k) {
    const float wt = renorm ? mine_w / total : mine_w;
    weights[(size_t)t * k + lane] = wt;
    ids[(size_t)t * k + lane] = mine_id;
    if (slots) slots[(size_t)t * k + lane] = slot_table[mine_id];
    if (route_row) {
      route_row[(size_t)t * 2 * k + lane] = (float)mine_id;
      route_row[(size_t)t * 2 * k + k + lane] = wt;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128)
    fused_route_topk(const float* logits, long long* ids, float* weights, int T, int E, int k,
                     int renorm, const int* slot_table, int* slots, float* route_row) {
  const int t = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (t >= T) return;
  topk_row(logits + (size_t)t * E, false, t, E, k, renorm, ids, weights, slot_table, slots, route_row);
}

// The router GEMV too: a warp per expert computes logits[t, e] = h[t] . router[e] for all T tokens
// (fp32), then the last block (threadfence + counter, left zero) runs topk_row per token.
template <bool HF>
__device__ __forceinline__ void router_body(const void* h, const float* router, float* logits, int T,
                                            int E, int H) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * 4 + warp;
  if (e >= E) return;
  const float* wr = router + (size_t)e * H;
  for (int t = 0; t < T; ++t) {                           // tokens one by one: no per-token arrays
    float acc = 0.f;
#pragma unroll 4
    for (int i = lane * 4; i < H; i += 128) {              // H % 4 == 0
      const float4 w4 = *(const float4*)(wr + i);
      float x0, x1, x2, x3;
      if (HF) {
        const float4 x4 = *(const float4*)((const float*)h + (size_t)t * H + i);
        x0 = x4.x; x1 = x4.y; x2 = x4.z; x3 = x4.w;
      } else {
        const uint2 raw = *(const uint2*)((const u16*)h + (size_t)t * H + i);
        x0 = h2f((u16)(raw.x & 0xffffu)); x1 = h2f((u16)(raw.x >> 16));
        x2 = h2f((u16)(raw.y & 0xffffu)); x3 = h2f((u16)(raw.y >> 16));
      }
      acc = fmaf(x3, w4.w, fmaf(x2, w4.z, fmaf(x1, w4.y, fmaf(x0, w4.x, acc))));
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[(size_t)t * E + e] = acc;
  }
}

extern "C" __global__ void __launch_bounds__(128)
    fused_router_topk(const void* h, int h_f32, const float* router, float* logits, int* counter,
                      int T, int E, int H, int k, int renorm, long long* ids, float* weights,
                      const int* slot_table, int* slots, float* route_row) {
  __shared__ int last;
  if (h_f32) router_body<true>(h, router, logits, T, E, H);
  else router_body<false>(h, router, logits, T, E, H);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int t = threadIdx.x >> 5; t < T; t += 4)
    topk_row(logits + (size_t)t * E, true, t, E, k, renorm, ids, weights, slot_table, slots, route_row);
  if (threadIdx.x == 0) *counter = 0;
}

// Residual add + RMSNorm + router + top-k in one launch (T <= 8, H <= 8192): every block makes the
// normed rows itself in shared memory (h rounded to x's dtype, exactly the h written; block 0 writes
// x_out and h), its warps' experts' logits from there, and the last block routes.
#define ANR_MAXH 8192

template <bool XF, int DM>
__device__ __forceinline__ void add_norm_router_body(const void* x, const void* delta, const float* w,
                                                     void* x_out, void* hout, int H, float eps,
                                                     const float* router, float* logits, int T, int E,
                                                     float* hs, float* part) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int e = blockIdx.x * 4 + warp;
  const float* wr = router + (size_t)(e < E ? e : 0) * H;
  for (int t = 0; t < T; ++t) {                           // tokens one by one
    const size_t row = (size_t)t * H;
    float ss = 0.f;
#pragma unroll 4
    for (int i = tid; i < H; i += 128) {
      const float v = resid<XF, DM>(x, delta, row + i);
      hs[i] = v;
      ss = fmaf(v, v, ss);
      if (DM && blockIdx.x == 0) store_x<XF>(x_out, row + i, v);
    }
    ss = warp_sum(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    const float rstd = rsqrtf((part[0] + part[1] + part[2] + part[3]) / (float)H + eps);
#pragma unroll 4
    for (int i = tid; i < H; i += 128) {                  // this thread's own elements of hs
      const float hv = round_x<XF>(hs[i] * rstd * w[i]);
      hs[i] = hv;
      if (blockIdx.x == 0) store_x<XF>(hout, row + i, hv);
    }
    __syncthreads();                                      // hs complete; part free again
    float acc = 0.f;
    if ((H & 3) == 0) {
#pragma unroll 4
      for (int i = lane * 4; i < H; i += 128) {
        const float4 w4 = *(const float4*)(wr + i);
        const float4 h4 = *(const float4*)(hs + i);
        acc = fmaf(h4.w, w4.w, fmaf(h4.z, w4.z, fmaf(h4.y, w4.y, fmaf(h4.x, w4.x, acc))));
      }
    } else {
#pragma unroll 4
      for (int i = lane; i < H; i += 32) acc = fmaf(hs[i], wr[i], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0 && e < E) logits[(size_t)t * E + e] = acc;
    __syncthreads();                                      // hs is rewritten by the next token
  }
}

extern "C" __global__ void __launch_bounds__(128)
    fused_add_norm_router(const void* x, const void* delta, const float* w, void* x_out, void* hout,
                          int H, float eps, int x_f32, int delta_f32, const float* router, float* logits,
                          int* counter, int T, int E, int k, int renorm, long long* ids, float* weights,
                          const int* slot_table, int* slots, float* route_row) {
  __shared__ __align__(16) float hs[ANR_MAXH];
  __shared__ float part[4];
  __shared__ int last;
  DISPATCH_XD(add_norm_router_body, x, delta, w, x_out, hout, H, eps, router, logits, T, E, hs, part);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int t = threadIdx.x >> 5; t < T; t += 4)
    topk_row(logits + (size_t)t * E, true, t, E, k, renorm, ids, weights, slot_table, slots, route_row);
  if (threadIdx.x == 0) *counter = 0;
}

// ---------------------------------------------------------------- one-token GQA attention
// Split s of KV head kvh takes keys [SK s, SK s + SK) (one per thread for q.k, then every
// thread accumulates its (head, dim) outputs over the split's keys), keeps (max, sum, acc) per query
// head, and the last split block of the head (threadfence + counter) combines the splits.
#define ATT_KEYS 128
#define ATT_MAXG 16     // query heads per KV head
#define ATT_MAXQ 2048   // g * D
#define ATT_MAXO (ATT_MAXQ / ATT_KEYS)
#define ATT_MAXW 1024   // splits x query heads the combine keeps in shared memory

struct AttnSmem {
  float qs[ATT_MAXQ];            // this KV head's g query heads [g, D] fp32 (16-byte aligned: first)
  float sc[ATT_MAXG][ATT_KEYS];  // scores, then exp(score - max) per query head
  float ml[ATT_MAXG][2];         // max, sum per query head
  float w[ATT_MAXW];             // combine: exp(max_s - max) per (split, query head)
  float wl[ATT_MAXW];            // combine: that times the split's sum
  int last;
};

// The attention of one (KV head, split) block once sm.qs holds the queries and the block's
// threads are synchronised; n = keys attended (0..n-1); SK <= 128 keys per split (64 gives short
// contexts twice the blocks and half the serial key loop per thread).
__device__ __forceinline__ void attn_body(AttnSmem& sm, const u16* k_store, const u16* v_store, int n,
                                          u16* out, float* partials, int* counters, int Hkv, int g,
                                          int D, float scale, int SK) {
  const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y, tid = threadIdx.x;
  const int start = split * SK, gd = g * D;
  const int key = start + tid;
  const bool valid = tid < SK && key < n;
  float s[ATT_MAXG];
#pragma unroll
  for (int h = 0; h < ATT_MAXG; ++h) s[h] = 0.f;
  if (valid) {
    const u16* kr = k_store + ((size_t)key * Hkv + kvh) * D;
#pragma unroll 4
    for (int c = 0; c < D; c += 8) {
      const uint4 raw = *(const uint4*)(kr + c);
      const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kf[2 * e] = h2f((u16)(w[e] & 0xffffu));
        kf[2 * e + 1] = h2f((u16)(w[e] >> 16));
      }
#pragma unroll
      for (int h = 0; h < ATT_MAXG; ++h) {
        if (h < g) {
          const float4 q0 = *(const float4*)(sm.qs + h * D + c);
          const float4 q1 = *(const float4*)(sm.qs + h * D + c + 4);
          s[h] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] +
                  q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < ATT_MAXG; ++h)
    if (h < g) sm.sc[h][tid] = valid ? s[h] * scale : NEG_INF;
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  for (int h = warp; h < g; h += 4) {                     // softmax pieces of this split, per head
    float v[4], m = NEG_INF, l = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) m = fmaxf(m, v[i] = sm.sc[h][lane + 32 * i]);
    m = warp_max(m);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float e = m == NEG_INF ? 0.f : expf(v[i] - m);
      sm.sc[h][lane + 32 * i] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) { sm.ml[h][0] = m; sm.ml[h][1] = l; }
  }
  __syncthreads();
  const int nk = n - start < SK ? (n - start > 0 ? n - start : 0) : SK;
  float acc[ATT_MAXO];
  int oh[ATT_MAXO], od[ATT_MAXO];
#pragma unroll
  for (int j = 0; j < ATT_MAXO; ++j) {
    const int o = tid + ATT_KEYS * j;
    acc[j] = 0.f;
    oh[j] = o < gd ? o / D : 0;
    od[j] = o < gd ? o - oh[j] * D : 0;
  }
  // outputs o = tid + 128 j: (head o / D, dim o % D). When D divides 128 every j has the same dim
  // (one V load per key); D = 256 alternates two dims; other D load per output.
  const u16* vbase = v_store + (size_t)kvh * D;
  if (ATT_KEYS % D == 0) {
    const u16* vcol = vbase + (size_t)start * Hkv * D + od[0];
    const size_t vstep = (size_t)Hkv * D;
    int kk = 0;
    for (; kk + 8 <= nk; kk += 8) {                       // 8 keys' loads in flight
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = h2f(vcol[(size_t)(kk + u) * vstep]);
#pragma unroll
      for (int u = 0; u < 8; ++u)
#pragma unroll
        for (int j = 0; j < ATT_MAXO; ++j)
          if (tid + ATT_KEYS * j < gd) acc[j] = fmaf(sm.sc[oh[j]][kk + u], v[u], acc[j]);
    }
    for (; kk < nk; ++kk) {
      const float v = h2f(vcol[(size_t)kk * vstep]);
#pragma unroll
      for (int j = 0; j < ATT_MAXO; ++j)
        if (tid + ATT_KEYS * j < gd) acc[j] = fmaf(sm.sc[oh[j]][kk], v, acc[j]);
    }
  } else if (D == 2 * ATT_KEYS) {
#pragma unroll 4
    for (int kk = 0; kk < nk; ++kk) {
      const u16* vr = vbase + (size_t)(start + kk) * Hkv * D;
      const float v0 = h2f(vr[tid]), v1 = h2f(vr[tid + ATT_KEYS]);
#pragma unroll
      for (int j = 0; j < ATT_MAXO; ++j)
        if (tid + ATT_KEYS * j < gd) acc[j] = fmaf(sm.sc[oh[j]][kk], (j & 1) ? v1 : v0, acc[j]);
    }
  } else {
#pragma unroll 2
    for (int kk = 0; kk < nk; ++kk) {
      const u16* vr = vbase + (size_t)(start + kk) * Hkv * D;
#pragma unroll
      for (int j = 0; j < ATT_MAXO; ++j)
        if (tid + ATT_KEYS * j < gd) acc[j] = fmaf(sm.sc[oh[j]][kk], h2f(vr[od[j]]), acc[j]);
    }
  }
  u16* ob = out + (size_t)kvh * gd;
  if (S == 1) {
#pragma unroll
    for (int j = 0; j < ATT_MAXO; ++j)
      if (tid + ATT_KEYS * j < gd) ob[tid + ATT_KEYS * j] = f2h(acc[j] / sm.ml[oh[j]][1]);
    return;
  }
  const int stride = D + 2;                               // per query head: acc [D], max, sum
  float* part = partials + ((size_t)kvh * S + split) * g * stride;
#pragma unroll
  for (int j = 0; j < ATT_MAXO; ++j)
    if (tid + ATT_KEYS * j < gd) part[oh[j] * stride + od[j]] = acc[j];
  if (tid < g) {
    part[tid * stride + D] = sm.ml[tid][0];
    part[tid * stride + D + 1] = sm.ml[tid][1];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) sm.last = atomicAdd(&counters[kvh], 1) == S - 1;
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  const float* head = partials + (size_t)kvh * S * g * stride;   // [S, g, stride]
  const int SG = S * g;
  if (SG <= ATT_MAXW) {
    // split weights per (split, head) in shared memory (all loads in flight at once), then every
    // output is one pass over the splits with its ATT_MAXO loads per split issued together
    for (int i = tid; i < SG; i += ATT_KEYS) sm.w[i] = ld_cg(head + (size_t)i * stride + D);
    __syncthreads();
    if (tid < g) {
      float mx = NEG_INF;
      for (int sp = 0; sp < S; ++sp) mx = fmaxf(mx, sm.w[sp * g + tid]);
      sm.ml[tid][0] = mx;
    }
    __syncthreads();
    for (int i = tid; i < SG; i += ATT_KEYS) {
      const float m = sm.w[i], wgt = m == NEG_INF ? 0.f : expf(m - sm.ml[i % g][0]);
      sm.w[i] = wgt;
      sm.wl[i] = wgt * ld_cg(head + (size_t)i * stride + D + 1);
    }
    __syncthreads();
    if (tid < g) {
      float l = 0.f;
      for (int sp = 0; sp < S; ++sp) l += sm.wl[sp * g + tid];
      sm.ml[tid][1] = l;
    }
    __syncthreads();
    float osum[ATT_MAXO];
#pragma unroll
    for (int j = 0; j < ATT_MAXO; ++j) osum[j] = 0.f;
    for (int sp = 0; sp < S; ++sp) {
      const float* ps = head + (size_t)sp * g * stride;
      float a[ATT_MAXO];
#pragma unroll
      for (int j = 0; j < ATT_MAXO; ++j)
        a[j] = tid + ATT_KEYS * j < gd ? ld_cg(ps + oh[j] * stride + od[j]) : 0.f;
#pragma unroll
      for (int j = 0; j < ATT_MAXO; ++j) osum[j] = fmaf(sm.w[sp * g + oh[j]], a[j], osum[j]);
    }
#pragma unroll
    for (int j = 0; j < ATT_MAXO; ++j)
      if (tid + ATT_KEYS * j < gd) ob[tid + ATT_KEYS * j] = f2h(osum[j] / sm.ml[oh[j]][1]);
    if (tid == 0) counters[kvh] = 0;
    return;
  }
#pragma unroll
  for (int j = 0; j < ATT_MAXO; ++j) {                    // many splits: per output, 4 splits at a time
    if (tid + ATT_KEYS * j >= gd) continue;
    const int h = oh[j], d = od[j];
    const float* hp = head + (size_t)h * stride;            // split sp's head h: hp + sp * g * stride
    const size_t sstep = (size_t)g * stride;
    float mx = NEG_INF;
    int sp = 0;
    for (; sp + 4 <= S; sp += 4) {                         // 4 splits' loads in flight
      const float a0 = ld_cg(hp + sp * sstep + D), a1 = ld_cg(hp + (sp + 1) * sstep + D);
      const float a2 = ld_cg(hp + (sp + 2) * sstep + D), a3 = ld_cg(hp + (sp + 3) * sstep + D);
      mx = fmaxf(mx, fmaxf(fmaxf(a0, a1), fmaxf(a2, a3)));
    }
    for (; sp < S; ++sp) mx = fmaxf(mx, ld_cg(hp + sp * sstep + D));
    float lsum = 0.f, osum = 0.f;
    for (sp = 0; sp + 4 <= S; sp += 4) {
      float ms[4], ls[4], os[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float* ps = hp + (sp + u) * sstep;
        ms[u] = ld_cg(ps + D);
        ls[u] = ld_cg(ps + D + 1);
        os[u] = ld_cg(ps + d);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float wgt = ms[u] == NEG_INF ? 0.f : expf(ms[u] - mx);
        lsum = fmaf(wgt, ls[u], lsum);
        osum = fmaf(wgt, os[u], osum);
      }
    }
    for (; sp < S; ++sp) {
      const float* ps = hp + sp * sstep;
      const float ms = ld_cg(ps + D);
      const float wgt = ms == NEG_INF ? 0.f : expf(ms - mx);
      lsum = fmaf(wgt, ld_cg(ps + D + 1), lsum);
      osum = fmaf(wgt, ld_cg(ps + d), osum);
    }
    ob[tid + ATT_KEYS * j] = f2h(osum / lsum);
  }
  if (tid == 0) counters[kvh] = 0;
}

extern "C" __global__ void __launch_bounds__(128)
    fused_decode_attn(const u16* q, const u16* k_store, const u16* v_store, const long long* pos,
                      int pos0, u16* out, float* partials, int* counters, int Hkv, int g, int D, int C,
                      float scale, int SK) {
  __shared__ __align__(16) AttnSmem sm;
  const long long p = pos ? pos[0] : (long long)pos0;
  const int n = (int)(p + 1 < (long long)C ? p + 1 : (long long)C);    // keys 0..p (<= 0: none)
  const int gd = g * D;
#pragma unroll 4
  for (int i = threadIdx.x; i < gd; i += ATT_KEYS) sm.qs[i] = h2f(q[(size_t)blockIdx.x * gd + i]);
  __syncthreads();
  attn_body(sm, k_store, v_store, n, out, partials, counters, Hkv, g, D, scale, SK);
}

// q/k RMSNorm + RoPE + KV write + attention for one token in one launch: every split block makes
// its KV head's g queries (the same fp16-rounded values fused_qk_rope_kv writes), and the block
// whose split holds position p also writes K and V row p before its threads read it.
extern "C" __global__ void __launch_bounds__(128)
    fused_rope_attn(const u16* qkv, const float* q_norm, const float* k_norm, const float* table,
                    int table_rows, const long long* pos, int pos0, u16* k_store, u16* v_store,
                    u16* out, float* partials, int* counters, int Hq, int Hkv, int D, int C, float eps,
                    float scale, int SK) {
  __shared__ __align__(16) AttnSmem sm;
  const int kvh = blockIdx.x, warp = threadIdx.x >> 5, g = Hq / Hkv;
  const long long p = pos ? pos[0] : (long long)pos0;
  const bool ok = p >= 0 && p < C && p < table_rows;
  const float* cs = table + (size_t)(ok ? p : 0) * 2 * D;
  for (int h = warp; h < g; h += 4)
    rope_head<true>(qkv + (size_t)(kvh * g + h) * D, q_norm, cs, D, eps, ok, nullptr, sm.qs + h * D);
  const int start = blockIdx.y * SK;
  if (ok && p >= start && p < start + SK) {
    if (warp == 0)
      rope_head<false>(qkv + (size_t)(Hq + kvh) * D, k_norm, cs, D, eps, true,
                       k_store + ((size_t)p * Hkv + kvh) * D, nullptr);
    const u16* vs = qkv + (size_t)(Hq + Hkv + kvh) * D;
    for (int i = threadIdx.x; i < D; i += ATT_KEYS) v_store[((size_t)p * Hkv + kvh) * D + i] = vs[i];
  }
  __syncthreads();                                        // queries in smem, row p in the store
  attn_body(sm, k_store, v_store, ok ? (int)p + 1 : 0, out, partials, counters, Hkv, g, D, scale, SK);
}

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
//   fused_decode_attn   grid (Hkv, S splits), block 128: one query token, GQA (g = Hq / Hkv),
//       flash-decoding; g <= 16, g * D <= 2048, D % 8 == 0, D <= 256. The launcher's plan (keys L, the
//       rows a launch covers: a graph's bucket): RK keys per round (RK = min(4 KP, 128), KP = 128 / Cp,
//       Cp = 2^cpl >= D / 8), R rounds per split, S splits (S * g <= 1024); split s takes keys
//       [R RK s, R RK (s + 1)). q [Hq, D] fp16, k_store / v_store [C, Hkv, D] fp16 (L <= C), keys
//       0..min(p, L - 1) attended (p = *pos or pos0; none when p < 0: NaN out) -> out [Hq, D] fp16;
//       partials [Hkv, S, g, D] then [Hkv, S, g, 2] fp32 and counters [Hkv] int (zero, and left zero:
//       the last split block of a KV head combines the partials and resets its counter)
//   fused_rope_attn     grid (Hkv, S splits), block 128, one token: fused_qk_rope_kv + fused_decode_attn
//       in one launch: qkv [1, (Hq + 2 Hkv) * D] fp16 -> out [Hq, D] fp16, K/V row p written by the
//       block whose split holds p (the last split when p is past them), the queries made by every block
//   fused_embed_rows    grid (T, ceil(H / 256)), block 256: ids [T] int64 -> out [T, H] (fp16 | fp32) = table[ids]
//       converted once; table [V, H] fp16 | fp32 | bf16 (src: EMB_F16 / EMB_F32 / EMB_BF16) anywhere the card
//       can read, e.g. pinned host memory (hybrid.runtime.host_embed). An id outside [0, V) writes NaN.
// Newer versions of three of them (same arguments and outputs; the launcher picks them by HYBRID_FUSED_NEW
// where H % 4 == 0 and the rows are 16-byte aligned):
//   fused_add_rms_norm_e     grid T, block 256: every load of a row at once (groups of 4 elements)
//   fused_add_norm_router_e  grid E, block 128: a block per expert, the norm from one round of loads,
//       the last block's top-k by a warp per token; optionally (offsets given, with slots, T * k <= 32) also
//       the grouped MoE kernels' routing for S slots, as qpn_moe_route makes it from slots: offsets [S+1]
//       (the entries of slots with work), perm [T*k], active [min(T*k, S)]; zero [nzero] fp32 zeroed (the
//       MoE output: one launch per layer fewer); rank (RANK_*): how the last block ranks the experts
//   fused_rope_attn_e        grid (Hkv, S), block 128: only the splits with keys run and combine
//   fused_rope_attn_w        grid (Hkv, S), block 256: fused_rope_attn_e with a split's rounds on two groups of
//       128 threads (each half of a round's key passes; HYBRID_FUSED_NEW part "wide", where a thread has at
//       most ATT_HPT_W query heads in P.V)

typedef unsigned int u32;
typedef unsigned short u16;

#define EMB_F16 0   // fused_embed_rows' table dtypes (fused.py _EMB)
#define EMB_F32 1
#define EMB_BF16 2

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+, qpn.cu's helpers; fused.py launches these kernels with it under
// HYBRID_PDL=1): every kernel lets the next one in the stream be scheduled on free SMs at its start
// (pdl_trigger), and waits for the one before it to finish, its writes visible, before it reads or writes
// anything (pdl_wait). No-ops without the launch attribute and below sm_90.
// QPN_SHARED: pdl_trigger pdl_wait

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

// True in the last of `blocks` blocks to arrive at counter, where every write the arriving blocks made
// before is visible: a barrier, then one thread's acq_rel atomic at gpu scope (its release orders what the
// block wrote before the barrier, the last block's acquire and barrier what it reads after; the pattern of
// CUTLASS's semaphores). One MEMBAR and one L1 invalidation on sm_90 where a fence + atomic + fence had two
// of each: the router's tail 0.2-0.3 us shorter per layer on the H200 (results/runtime.md §32). sm_70+ PTX.
__device__ __forceinline__ bool arrive_last(int* counter, int blocks, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    *flag = old == blocks - 1;
  }
  __syncthreads();
  return *flag;
}

__device__ __forceinline__ float ld_cg(const float* p) {   // L2, not a possibly stale L1 line
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// ---------------------------------------------------------------- embedding rows
// One element per thread, every load of a launch at once: the table is read where it lies, which for the
// runtime's decode graphs is pinned host memory mapped into the card's address space (one row of H
// elements per token crosses the bus; the table is never copied to the card), so the only latency is one
// round trip over the bus. The row's conversion is exact where torch's .to(dtype) is (one rounding, RNE).
extern "C" __global__ void __launch_bounds__(256)
    fused_embed_rows(const void* __restrict__ table, const long long* __restrict__ ids, void* __restrict__ out,
                     int H, long long V, int src, int out_f32) {
  pdl_trigger();
  pdl_wait();
  const int i = blockIdx.y * 256 + threadIdx.x;
  if (i >= H) return;
  const long long id = ids[blockIdx.x];
  float v = __int_as_float(0x7fc00000);                  // an id outside the table: NaN
  if (id >= 0 && id < V) {
    const size_t at = (size_t)id * (size_t)H + (size_t)i;
    if (src == EMB_F32)
      v = ((const float*)table)[at];
    else if (src == EMB_BF16)
      v = __uint_as_float((u32)((const u16*)table)[at] << 16);
    else
      v = h2f(((const u16*)table)[at]);
  }
  const size_t o = (size_t)blockIdx.x * (size_t)H + (size_t)i;
  if (out_f32)
    ((float*)out)[o] = v;
  else
    ((u16*)out)[o] = f2h(v);
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
  pdl_trigger();
  pdl_wait();
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
  pdl_trigger();
  pdl_wait();
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

// A warp's softmax in place: v[j] the logit of expert lane + 32 j (NEG_INF past E) -> its probability (-1 past
// E: below every probability); the max and sum by warp reductions.
template <int NV>
__device__ __forceinline__ void softmax_lanes(float (&v)[NV], int E, int lane) {
  float m = NEG_INF;
#pragma unroll
  for (int j = 0; j < NV; ++j) m = fmaxf(m, v[j]);
  m = warp_max(m);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    v[j] = lane + 32 * j < E ? expf(v[j] - m) : 0.f;
    s += v[j];
  }
  s = warp_sum(s);
#pragma unroll
  for (int j = 0; j < NV; ++j) v[j] = lane + 32 * j < E ? v[j] / s : -1.f;   // probs >= 0
}

// One round of a warp's top-k: the largest probability left in v (ties to the lowest id) in every lane as
// (best, bi), then marked taken (-2) in the lane that holds it.
template <int NV>
__device__ __forceinline__ void argmax_round(float (&v)[NV], int lane, float& best, int& bi) {
  best = -2.f;
  bi = 0x7fffffff;
#pragma unroll
  for (int j = 0; j < NV; ++j)
    if (v[j] > best) { best = v[j]; bi = lane + 32 * j; }   // ascending ids: keeps the lowest
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
  }
#pragma unroll
  for (int j = 0; j < NV; ++j)
    if (lane + 32 * j == bi) v[j] = -2.f;                    // taken
}

// k rounds of argmax_round: lane r < k keeps the r-th choice (weight, id); total = the k weights' sum
template <int NV>
__device__ __forceinline__ void select_k(float (&v)[NV], int lane, int k, float& mine_w, int& mine_id,
                                         float& total) {
  mine_w = 0.f, total = 0.f;
  mine_id = 0;
#pragma unroll 1
  for (int r = 0; r < k; ++r) {
    float best;
    int bi;
    argmax_round<NV>(v, lane, best, bi);
    if (lane == r) { mine_w = best; mine_id = bi; }
    total += best;
  }
}

// The last block's ranking (its kernel argument `rank`, fused.py's HYBRID_ROUTE_RANK): RANK_ROUNDS = softmax_lanes,
// then select_k's k rounds of a 5-level shuffle argmax (Volta always; bit-identical to topk_row); RANK_LOGITS
// (sm_80+) = select_k_logits. H200 (results/runtime.md §39): the rounds with redux.sync on the probabilities saved
// 0.45-0.68 us per layer of the router, on the logits with no softmax over all E 0.5 more; a butterfly merge of the
// lanes' sorted top-8 lists (fewer dependent shuffles, more instructions) was 0.55 us slower than the rounds.
#define RANK_ROUNDS 0
#define RANK_LOGITS 1

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// order-preserving float -> u32 (a larger float, a larger key; -0 as +0); 0 is below every logit but one NaN
// pattern, and is what past E and the taken hold
__device__ __forceinline__ u32 logit_key(float x) {
  const u32 b = __float_as_uint(x + 0.f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_logit(u32 key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// RANK_LOGITS: k rounds, each the lane's largest key (lowest j first), the warp's by one redux.sync max and the
// lowest id holding it by one redux.sync min, on the logits (softmax is monotonic: the same experts as the rounds on
// probabilities, ties to the lowest id, where distinct logits do not round to one probability); each round's
// weight exp(logit - top logit) (round 0's logit is the largest: no warp max), the total their sum in rank order.
// The probabilities of all E are made only without renorm (the softmax's sum). Weights within 2e-6 of the rounds'.
template <int NV>
__device__ __forceinline__ void select_k_logits(const float (&l)[NV], int lane, int E, int k, int renorm,
                                                float& mine_w, int& mine_id, float& total) {
  u32 key[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) key[j] = lane + 32 * j < E ? logit_key(l[j]) : 0u;
  float top = 0.f;
  mine_w = 0.f, total = 0.f;
  mine_id = 0;
#pragma unroll 1
  for (int r = 0; r < k; ++r) {
    u32 b = key[0];
    int bj = 0;
#pragma unroll
    for (int j = 1; j < NV; ++j)
      if (key[j] > b) { b = key[j]; bj = j; }
    const u32 m = __reduce_max_sync(0xffffffffu, b);
    const u32 bi = __reduce_min_sync(0xffffffffu, b == m ? (u32)(lane + 32 * bj) : 0xffffffffu);
    const float x = key_logit(m);
    if (r == 0) top = x;
    const float e = expf(x - top);
    if (lane == r) { mine_w = e; mine_id = (int)bi; }
    total += e;
#pragma unroll
    for (int j = 0; j < NV; ++j)
      if (lane + 32 * j == (int)bi) key[j] = 0u;             // taken
  }
  if (!renorm) {                                            // the softmax's sum over all E
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) s += lane + 32 * j < E ? expf(l[j] - top) : 0.f;
    mine_w /= warp_sum(s);
  }
}
#endif

// Lane r < k of token t writes its choice: weight (renormalised by the k chosen weights' total), id, slot and
// the route row (ids, then weights).
__device__ __forceinline__ void write_choice(int t, int k, int lane, float w, float total, int id, int slot,
                                             int renorm, long long* ids, float* weights, int* slots,
                                             float* route_row) {
  if (lane >= k) return;
  const float wt = renorm ? w / total : w;
  weights[(size_t)t * k + lane] = wt;
  ids[(size_t)t * k + lane] = id;
  if (slots) slots[(size_t)t * k + lane] = slot;
  if (route_row) {
    route_row[(size_t)t * 2 * k + lane] = (float)id;
    route_row[(size_t)t * 2 * k + k + lane] = wt;
  }
}

// One warp: softmax over row[0..E), top-k (descending, ties to the lowest id), optional renorm;
// lane r < k writes the r-th choice of token t (and the runtime's slot id and route row).
__device__ __forceinline__ void topk_row(const float* row, bool l2, int t, int E, int k, int renorm,
                                         long long* ids, float* weights, const int* slot_table,
                                         int* slots, float* route_row) {
  const int lane = threadIdx.x & 31;
  float v[ROUTE_MAXV];
#pragma unroll
  for (int j = 0; j < ROUTE_MAXV; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? (l2 ? ld_cg(row + e) : row[e]) : NEG_INF;
  }
  softmax_lanes<ROUTE_MAXV>(v, E, lane);
  float mine_w, total;
  int mine_id;
  select_k<ROUTE_MAXV>(v, lane, k, mine_w, mine_id, total);
  const int slot = slots && lane < k ? slot_table[mine_id] : -1;
  write_choice(t, k, lane, mine_w, total, mine_id, slot, renorm, ids, weights, slots, route_row);
}

extern "C" __global__ void __launch_bounds__(128)
    fused_route_topk(const float* logits, long long* ids, float* weights, int T, int E, int k,
                     int renorm, const int* slot_table, int* slots, float* route_row) {
  pdl_trigger();
  pdl_wait();
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
  pdl_trigger();
  pdl_wait();
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
  pdl_trigger();
  pdl_wait();
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

// ---------------------------------------------------------------- vectorised add + RMSNorm (+ router)
// fused_add_norm_router_e: fused_add_norm_router's outputs (T <= 8, H % 4 == 0, 16-byte aligned rows) from
// one block of 128 threads per expert (grid E). Thread t owns the groups of 4 elements t + 128 j of a row:
// it loads its slice of the expert's router row, of w and of token 0's x / delta at once (one latency),
// makes the residual and the block's sum of squares (one barrier per token), then h (rounded to x's
// dtype) and its share of the dot product; token t + 1's x / delta loads are in flight during token t's
// math. Groups j >= ANRE_NJ (H > 2048) go through shared memory. The last block (arrive_last; the counter
// left zero) routes each token with topk_warp (a warp per token: topk_row's outputs, the slot table read with
// the logits, prefetched into every SM's L1 at the start), then warp 0 makes the MoE plan.
#define ANRE_NJ 4         // groups of 4 elements per thread kept in registers: H <= 2048

template <bool F32>
__device__ __forceinline__ uint4 ld4(const void* p, size_t i) {   // elements i..i+3, raw bits
  if (F32) return *(const uint4*)((const float*)p + i);
  const uint2 r = *(const uint2*)((const u16*)p + i);
  return make_uint4(r.x, r.y, 0u, 0u);
}
template <bool F32>
__device__ __forceinline__ void cvt4(uint4 r, float (&f)[4]) {
  if (F32) {
    f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
  } else {
    f[0] = h2f((u16)(r.x & 0xffffu)); f[1] = h2f((u16)(r.x >> 16));
    f[2] = h2f((u16)(r.y & 0xffffu)); f[3] = h2f((u16)(r.y >> 16));
  }
}
template <bool F32>
__device__ __forceinline__ void st4(void* p, size_t i, const float (&f)[4]) {
  if (F32) *(float4*)((float*)p + i) = make_float4(f[0], f[1], f[2], f[3]);
  else *(uint2*)((u16*)p + i) = make_uint2((u32)f2h(f[0]) | ((u32)f2h(f[1]) << 16),
                                           (u32)f2h(f[2]) | ((u32)f2h(f[3]) << 16));
}
template <bool XF, int DM>   // resid<XF, DM> of 4 elements from their raw loads
__device__ __forceinline__ void resid4(uint4 xr, uint4 dr, float (&v)[4]) {
  cvt4<XF>(xr, v);
  if (DM) {
    float d[4];
    cvt4<DM == 2>(dr, d);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float de = XF ? d[i] : h2f(f2h(d[i]));
      v[i] = XF ? v[i] + de : h2f(f2h(v[i] + de));
    }
  }
}

// fused_add_rms_norm_e: fused_add_rms_norm's outputs (H % 4 == 0, 16-byte aligned rows), grid T, block 256:
// a thread's groups of 4 elements (t + 256 j) of x, delta and w loaded at once, one barrier.
#define ARN_NJ 4          // groups per thread kept in registers: H <= 4096 (beyond: loaded again)

template <bool XF, int DM>
__device__ __forceinline__ void add_rms_norm_e_body(const void* x, const void* delta, const float* w,
                                                    void* x_out, void* h, float* hf, int H, float eps,
                                                    float* part) {
  const int tid = threadIdx.x, NG = H >> 2;
  const size_t row = (size_t)blockIdx.x * H;
  uint4 xr[ARN_NJ], dr[ARN_NJ];
  float4 ww[ARN_NJ];
#pragma unroll
  for (int j = 0; j < ARN_NJ; ++j) {
    const int gi = tid + 256 * j;
    xr[j] = dr[j] = make_uint4(0u, 0u, 0u, 0u);
    ww[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (gi < NG) {
      xr[j] = ld4<XF>(x, row + 4 * gi);
      if (DM) dr[j] = ld4<DM == 2>(delta, row + 4 * gi);
      ww[j] = *(const float4*)(w + 4 * gi);
    }
  }
  float v[ARN_NJ][4];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < ARN_NJ; ++j) {
    const int gi = tid + 256 * j;
    resid4<XF, DM>(xr[j], dr[j], v[j]);
    if (DM && gi < NG) st4<XF>(x_out, row + 4 * gi, v[j]);
#pragma unroll
    for (int i = 0; i < 4; ++i) ss = fmaf(v[j][i], v[j][i], ss);
  }
  for (int gi = tid + 256 * ARN_NJ; gi < NG; gi += 256) {
    float u[4];
    resid4<XF, DM>(ld4<XF>(x, row + 4 * gi), DM ? ld4<DM == 2>(delta, row + 4 * gi) : make_uint4(0u, 0u, 0u, 0u), u);
    if (DM) st4<XF>(x_out, row + 4 * gi, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) ss = fmaf(u[i], u[i], ss);
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) part[tid >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) tot += part[j];
  const float rstd = rsqrtf(tot / (float)H + eps);
#pragma unroll
  for (int j = 0; j < ARN_NJ; ++j) {
    const int gi = tid + 256 * j;
    if (gi < NG) {
      float hv[4];
      hv[0] = round_x<XF>(v[j][0] * rstd * ww[j].x); hv[1] = round_x<XF>(v[j][1] * rstd * ww[j].y);
      hv[2] = round_x<XF>(v[j][2] * rstd * ww[j].z); hv[3] = round_x<XF>(v[j][3] * rstd * ww[j].w);
      st4<XF>(h, row + 4 * gi, hv);
      if (hf) *(float4*)(hf + row + 4 * gi) = make_float4(hv[0], hv[1], hv[2], hv[3]);
    }
  }
  for (int gi = tid + 256 * ARN_NJ; gi < NG; gi += 256) {   // H > 4096: made again from x / delta
    float u[4], hv[4];
    resid4<XF, DM>(ld4<XF>(x, row + 4 * gi), DM ? ld4<DM == 2>(delta, row + 4 * gi) : make_uint4(0u, 0u, 0u, 0u), u);
    const float4 w4 = *(const float4*)(w + 4 * gi);
    hv[0] = round_x<XF>(u[0] * rstd * w4.x); hv[1] = round_x<XF>(u[1] * rstd * w4.y);
    hv[2] = round_x<XF>(u[2] * rstd * w4.z); hv[3] = round_x<XF>(u[3] * rstd * w4.w);
    st4<XF>(h, row + 4 * gi, hv);
    if (hf) *(float4*)(hf + row + 4 * gi) = make_float4(hv[0], hv[1], hv[2], hv[3]);
  }
}

extern "C" __global__ void __launch_bounds__(256)
    fused_add_rms_norm_e(const void* x, const void* delta, const float* w, void* x_out, void* h,
                         float* hf, int H, float eps, int x_f32, int delta_f32) {
  pdl_trigger();
  pdl_wait();
  __shared__ float part[8];
  DISPATCH_XD(add_rms_norm_e_body, x, delta, w, x_out, h, hf, H, eps, part);
}

template <bool XF, int DM>
__device__ __forceinline__ void anre_body(const void* x, const void* delta, const float* w, void* x_out,
                                          void* hout, int H, float eps, const float* router, float* logits,
                                          int T, int E, float* hs, float (*pss)[4], float (*pacc)[4]) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, e = blockIdx.x, NG = H >> 2;
  const bool b0 = blockIdx.x == 0;
  const float* wr = router + (size_t)e * H;
  float4 rr[ANRE_NJ], ww[ANRE_NJ];
  uint4 xr[ANRE_NJ], dr[ANRE_NJ];
#pragma unroll
  for (int j = 0; j < ANRE_NJ; ++j) {                     // every load of token 0 first: one latency
    const int gi = tid + 128 * j;
    rr[j] = ww[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    xr[j] = dr[j] = make_uint4(0u, 0u, 0u, 0u);
    if (gi < NG) {
      rr[j] = *(const float4*)(wr + 4 * gi);
      ww[j] = *(const float4*)(w + 4 * gi);
      xr[j] = ld4<XF>(x, 4 * gi);
      if (DM) dr[j] = ld4<DM == 2>(delta, 4 * gi);
    }
  }
  for (int t = 0; t < T; ++t) {
    const size_t row = (size_t)t * H;
    float v[ANRE_NJ][4];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < ANRE_NJ; ++j) {                   // zeros past H
      const int gi = tid + 128 * j;
      resid4<XF, DM>(xr[j], dr[j], v[j]);
      if (DM && b0 && gi < NG) st4<XF>(x_out, row + 4 * gi, v[j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) ss = fmaf(v[j][i], v[j][i], ss);
    }
    if (t + 1 < T) {                                      // the next token's loads, in flight meanwhile
#pragma unroll
      for (int j = 0; j < ANRE_NJ; ++j) {
        const int gi = tid + 128 * j;
        if (gi < NG) {
          xr[j] = ld4<XF>(x, row + H + 4 * gi);
          if (DM) dr[j] = ld4<DM == 2>(delta, row + H + 4 * gi);
        }
      }
    }
    for (int gi = tid + 128 * ANRE_NJ; gi < NG; gi += 128) {   // H > 2048: this thread's groups in hs
      float u[4];
      resid4<XF, DM>(ld4<XF>(x, row + 4 * gi), DM ? ld4<DM == 2>(delta, row + 4 * gi) : make_uint4(0u, 0u, 0u, 0u), u);
      *(float4*)(hs + 4 * gi) = make_float4(u[0], u[1], u[2], u[3]);
      if (DM && b0) st4<XF>(x_out, row + 4 * gi, u);
#pragma unroll
      for (int i = 0; i < 4; ++i) ss = fmaf(u[i], u[i], ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) pss[t][warp] = ss;
    __syncthreads();
    const float rstd = rsqrtf((pss[t][0] + pss[t][1] + pss[t][2] + pss[t][3]) / (float)H + eps);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < ANRE_NJ; ++j) {
      const int gi = tid + 128 * j;
      if (gi < NG) {
        float hv[4];
        hv[0] = round_x<XF>(v[j][0] * rstd * ww[j].x); hv[1] = round_x<XF>(v[j][1] * rstd * ww[j].y);
        hv[2] = round_x<XF>(v[j][2] * rstd * ww[j].z); hv[3] = round_x<XF>(v[j][3] * rstd * ww[j].w);
        if (b0) st4<XF>(hout, row + 4 * gi, hv);
        acc = fmaf(hv[3], rr[j].w, fmaf(hv[2], rr[j].z, fmaf(hv[1], rr[j].y, fmaf(hv[0], rr[j].x, acc))));
      }
    }
    for (int gi = tid + 128 * ANRE_NJ; gi < NG; gi += 128) {
      const float4 u = *(const float4*)(hs + 4 * gi), w4 = *(const float4*)(w + 4 * gi);
      const float4 r4 = *(const float4*)(wr + 4 * gi);
      float hv[4];
      hv[0] = round_x<XF>(u.x * rstd * w4.x); hv[1] = round_x<XF>(u.y * rstd * w4.y);
      hv[2] = round_x<XF>(u.z * rstd * w4.z); hv[3] = round_x<XF>(u.w * rstd * w4.w);
      if (b0) st4<XF>(hout, row + 4 * gi, hv);
      acc = fmaf(hv[3], r4.w, fmaf(hv[2], r4.z, fmaf(hv[1], r4.y, fmaf(hv[0], r4.x, acc))));
    }
    acc = warp_sum(acc);
    if (lane == 0) pacc[t][warp] = acc;
  }
  __syncthreads();
  if (tid < T) logits[(size_t)tid * E + e] = (pacc[tid][0] + pacc[tid][1]) + (pacc[tid][2] + pacc[tid][3]);
}

// Values per lane of the router's last block (topk_warp): the smallest of 4, 8, 16 that holds E experts.
#define TOPK_NV(E) ((E) <= 128 ? 4 : (E) <= 256 ? 8 : ROUTE_MAXV)

// Softmax + top-k of one token's logits by one warp, topk_row's outputs from its parts (softmax_lanes, k
// rounds of argmax_round, write_choice) at NV values per lane instead of ROUTE_MAXV; the slot table is loaded
// with the logits (NV entries per lane) and each choice's slot fetched by shuffles, so lane r < k returns
// choice r's slot (-1 without slots). The router's last block runs it, a warp per token:
// compact code (the k rounds a loop, the loops sized by E), no barrier: that block's instructions come from a
// cold instruction cache once per layer (results/runtime.md §31: the earlier block-wide ranks, with 16 values
// per lane whatever E, took 12.5 us per layer in the model; this 9.6).
template <int NV>
__device__ __forceinline__ int topk_warp(const float* row, int t, int E, int k, int renorm, long long* ids,
                                         float* weights, const int* slot_table, int* slots, float* route_row,
                                         int rank) {
  const int lane = threadIdx.x & 31;
  float v[NV];
  int tv[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? ld_cg(row + e) : NEG_INF;
    tv[j] = slots && e < E ? slot_table[e] : -1;
  }
  float mine_w, total;
  int mine_id;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if (rank == RANK_LOGITS) {
    select_k_logits<NV>(v, lane, E, k, renorm, mine_w, mine_id, total);
  } else
#endif
  {
    softmax_lanes<NV>(v, E, lane);
    select_k<NV>(v, lane, k, mine_w, mine_id, total);
  }
  int slot = -1;
#pragma unroll
  for (int j = 0; j < NV; ++j) {                          // choice mine_id's slot from lane mine_id % 32
    const int sj = __shfl_sync(0xffffffffu, tv[j], mine_id & 31);
    if ((mine_id >> 5) == j) slot = sj;
  }
  write_choice(t, k, lane, mine_w, total, mine_id, slot, renorm, ids, weights, slots, route_row);
  return slots && lane < k ? slot : -1;
}

// The grouped MoE kernels' routing (qpn.cu's qpn_moe_route outputs) from A = T * k <= 32 slot ids, by warp 0
// of the router's last block, lane a holding assignment a's slot s (ids outside [0, S) dropped): offsets[s],
// offsets[s + 1] of every slot s with an assignment (the only entries the expert kernels read), perm [A']
// (the kept assignments grouped by slot, ascending, each slot's in assignment order), active [min(A, S)]
// (the slots with work, ascending; -1 after). No shared memory, no barrier, no atomics (the block's tail
// is on the decode step's critical path): the lanes of s from __match_any_sync, the kept and the
// first-of-their-slot lanes from ballots, one pass of shuffles for the kept ids below s and the distinct
// slots below s. perm's order within a slot is fixed (qpn_moe_route's follows its shared-memory atomics).
__device__ __forceinline__ void route_plan_warp(int s, int A, int S, int* offsets, int* perm, int* active) {
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  if (lane >= A) s = -1;
  const bool valid = lane < A && s >= 0 && s < S;
  const unsigned mine = __match_any_sync(full, s);        // lanes with slot s
  const bool first = valid && __ffs(mine) - 1 == lane;
  const unsigned vm = __ballot_sync(full, valid), fm = __ballot_sync(full, first);
  int before = 0, dless = 0;                              // kept ids below s; distinct slots below s
  for (int b = 0; b < A; ++b) {
    const int less = __shfl_sync(full, s, b) < s;
    before += less & (int)((vm >> b) & 1u);
    dless += less & (int)((fm >> b) & 1u);
  }
  if (valid) {
    perm[before + __popc(mine & ((1u << lane) - 1u))] = lane;
    if (first) {
      active[dless] = s;
      offsets[s] = before;
      offsets[s + 1] = before + __popc(mine);
    }
  }
  const int na = A < S ? A : S;
  for (int i = __popc(fm) + lane; i < na; i += 32) active[i] = -1;
}

// The router's last block: each token routed by topk_warp<NV> (a warp per token), then (offsets given, with
// slots, T * k <= 32) the MoE plan by warp 0 from assignment a's slot in lane a (for T > 1 through si [T * k]).
// One function per NV, dispatched once, so the values the compiler hoists out of the token loop are those of
// the instantiation that runs.
template <int NV>
__device__ __forceinline__ void route_tokens(const float* logits, int T, int E, int k, int renorm, long long* ids,
                                             float* weights, const int* slot_table, int* slots, float* route_row,
                                             int S, int* offsets, int* perm, int* active, int* si, int rank) {
  const bool plan = offsets != nullptr && slots != nullptr && T * k <= 32;
  int own_slot = -1;
  for (int t = threadIdx.x >> 5; t < T; t += 4) {         // a warp per token
    const int s = topk_warp<NV>(logits + (size_t)t * E, t, E, k, renorm, ids, weights, slot_table, slots, route_row,
                                rank);
    if (T == 1) own_slot = s;
    else if (plan && (threadIdx.x & 31) < k) si[t * k + (threadIdx.x & 31)] = s;
  }
  if (plan && T > 1) {                                    // assignment a's slot to lane a of warp 0
    __syncthreads();
    if (threadIdx.x < T * k) own_slot = si[threadIdx.x];
  }
  if (plan && threadIdx.x < 32) route_plan_warp(own_slot, T * k, S, offsets, perm, active);
}

extern "C" __global__ void __launch_bounds__(128)
    fused_add_norm_router_e(const void* x, const void* delta, const float* w, void* x_out, void* hout,
                            int H, float eps, int x_f32, int delta_f32, const float* router, float* logits,
                            int* counter, int T, int E, int k, int renorm, long long* ids, float* weights,
                            const int* slot_table, int* slots, float* route_row, int S, int* offsets,
                            int* perm, int* active, float* zero, int nzero, int rank) {
  pdl_trigger();
  pdl_wait();
  __shared__ __align__(16) float hs[ANR_MAXH];           // H > 2048: the residual
  __shared__ float pss[ROUTER_MAXT][4], pacc[ROUTER_MAXT][4];
  __shared__ int si[32];                                  // T > 1: assignment a's slot, for the MoE plan
  __shared__ int last;
  if (slots != nullptr && 32 * threadIdx.x < E)           // the slot table's 128-byte lines into every SM's L1:
    asm volatile("prefetch.global.L1 [%0];" :: "l"(slot_table + 32 * threadIdx.x));   // the last block's hit
  DISPATCH_XD(anre_body, x, delta, w, x_out, hout, H, eps, router, logits, T, E, hs, pss, pacc);
  const bool is_last = arrive_last(counter, gridDim.x, &last);
  for (int j = 4 * (blockIdx.x * 128 + threadIdx.x); j < nzero; j += 4 * 128 * gridDim.x)   // the MoE output
    *(float4*)(zero + j) = make_float4(0.f, 0.f, 0.f, 0.f);
  if (!is_last) return;
  const int nv = TOPK_NV(E);                              // one instantiation's code runs (and is fetched)
  if (nv == 4) route_tokens<4>(logits, T, E, k, renorm, ids, weights, slot_table, slots, route_row, S, offsets, perm,
                               active, si, rank);
  else if (nv == 8) route_tokens<8>(logits, T, E, k, renorm, ids, weights, slot_table, slots, route_row, S, offsets,
                                    perm, active, si, rank);
  else route_tokens<ROUTE_MAXV>(logits, T, E, k, renorm, ids, weights, slot_table, slots, route_row, S, offsets,
                                perm, active, si, rank);
  if (threadIdx.x == 0) *counter = 0;
}

// ---------------------------------------------------------------- one-token GQA attention
// Flash-decoding. Block (KV head kvh, split s) of 128 threads attends keys [SK s, SK s + SK) for the
// g query heads of kvh (one K/V read shared by the g heads), SK = R rounds of RK keys. Thread t is
// (chunk c = t % Cp, slot r = t / Cp), Cp = 2^cpl >= D / 8 lanes per K/V row (16-byte chunks, the
// chunks c >= D / 8 idle), KP = 128 / Cp slots: in a round it loads chunk c of K and V rows
// rs + r + KP i (i < NP = RK / KP <= 4; the next round's loads are issued before this round's math,
// the first round's before the position is known). Scores: 8-element partial dot products, summed
// over the Cp lanes of a row by a transposing butterfly (4 heads x 4 keys per lane at a time).
// Online softmax per head (exp2 of scores pre-scaled by log2 e / sqrt(D)), then P.V from the round's V
// tile in shared memory (fp32): thread (c, r) owns dims [4c, 4c + 4) and [4(c + C), 4(c + C) + 4) of
// heads r, r + KP, ... Splits with keys write (acc [g, D], max, sum); the last block of the KV head
// (threadfence + counter) combines them. Splits past the last key write nothing and are not read.
#define ATT_THREADS 128
#define ATT_MAXG 16     // query heads per KV head
#define ATT_MAXQ 2048   // g * D
#define ATT_MAXRK 128   // keys per round (RK = min(4 KP, 128))
#define ATT_VTILE 4096  // floats of a round's V tile: RK * D <= 4096
#define ATT_NP 4        // key passes per round
#define ATT_HPT 4       // query heads per thread in P.V: ceil(g / KP)
#define ATT_HPT_W 2     // the same in fused_rope_attn_w (its launcher: ceil(g / KP) <= 2)
#define ATT_HPT_OF(GR) (GR == 1 ? ATT_HPT : ATT_HPT_W)
#define ATT_MAXW 1024   // splits x query heads the combine keeps in shared memory
#define ATT_PF 12       // splits of partials per output group the combine loads before the weights
#define LOG2E 1.4426950408889634f

struct AttnSmem {
  float qs[ATT_MAXQ];                 // this KV head's g queries [g, D] fp32 (16-byte aligned: first)
  union {
    float vt[ATT_VTILE];              // the round's V rows [RK, D] fp32
    struct { float w[ATT_MAXW], wl[ATT_MAXW]; } c;   // combine: per (split, head) weight, weight x sum
  } u;
  float sc[ATT_MAXG][ATT_MAXRK];      // the round's scores, then exp2(score - max)
  float m[ATT_MAXG], l[ATT_MAXG], al[ATT_MAXG];     // running max, sum; this round's rescale
  float kn[256], vn[256];             // fused_rope_attn: K and V row p (fp16-rounded values)
  int last;
};

struct AttnArgs {
  const u16 *k_store, *v_store;
  u16* out;
  float* partials;   // [Hkv, S, g, D] acc, then [Hkv, S, g, 2] (max, sum)
  int* counters;
  int Hkv, g, D, L, RK, R, cpl;
  float scale2;      // log2(e) / sqrt(D)
};

__device__ __forceinline__ uint4 ldg_v4(const u16* p) {   // issued where written (volatile)
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ float4 ld_cg4(const float* p) {   // L2, not a possibly stale L1 line
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void unpack8(uint4 raw, float* f) {
  const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[2 * e] = h2f((u16)(w[e] & 0xffffu));
    f[2 * e + 1] = h2f((u16)(w[e] >> 16));
  }
}

// GR groups of ATT_THREADS threads share a split's rounds (fused_rope_attn_w: GR = 2): thread t is lane
// lt = t % ATT_THREADS of group t / ATT_THREADS, which owns the PS = ATT_NP / GR key passes grp PS .. of a
// round (its K/V loads, its share of the scores and of P.V); with GR = 1 this is the single group's layout.
#define ATT_GROUP(GR) const int lt = GR == 1 ? (int)threadIdx.x : (int)threadIdx.x % ATT_THREADS, \
                            grp = GR == 1 ? 0 : (int)threadIdx.x / ATT_THREADS

// Chunk c of the K and V rows rs + r + KP i (i: the group's passes, i < NP, rows < L) of KV head kvh;
// zeros elsewhere.
template <int GR>
__device__ __forceinline__ void attn_load(const AttnArgs& a, int rs, uint4 (&kq)[ATT_NP / GR],
                                          uint4 (&vq)[ATT_NP / GR]) {
  const unsigned ul = GR == 1 ? threadIdx.x : threadIdx.x % ATT_THREADS;   // ATT_GROUP's lt
  const int grp = GR == 1 ? 0 : (int)threadIdx.x / ATT_THREADS;
  const int cpl = a.cpl, c = ul & ((1 << cpl) - 1), r = ul >> cpl;
  const int KP = ATT_THREADS >> cpl, NP = a.RK / KP;
#pragma unroll
  for (int ii = 0; ii < ATT_NP / GR; ++ii) {
    const int i = grp * (ATT_NP / GR) + ii, key = rs + r + KP * i;
    kq[ii] = vq[ii] = make_uint4(0u, 0u, 0u, 0u);
    if (i < NP && 8 * c < a.D && key < a.L) {
      const size_t off = ((size_t)key * a.Hkv + blockIdx.x) * a.D + 8 * c;
      kq[ii] = ldg_v4(a.k_store + off);
      vq[ii] = ldg_v4(a.v_store + off);
    }
  }
}

// One stage of the transposing butterfly: lanes c and c ^ o each keep one half of their first 2 M2
// values (the upper half where c & o) and add the partner's copy of it.
template <int M2>
__device__ __forceinline__ void butterfly_stage(float (&s)[16], int c, int o) {
  const bool up = (c & o) != 0;
#pragma unroll
  for (int j = 0; j < M2; ++j) {
    const float send = up ? s[j] : s[j + M2], keep = up ? s[j + M2] : s[j];
    s[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
  }
}

// Score v of a lane after the butterfly: head h0 + v / PS, key pass grp PS + v % PS (keys past n: -inf).
template <int PS>
__device__ __forceinline__ void put_score(AttnSmem& sm, int h0, int v, float x, int g, int NP, int r,
                                          int KP, int rs, int n, float scale2, int grp) {
  const int hh = v >> (PS == 4 ? 2 : 1), i = grp * PS + (v & (PS - 1)), kl = r + KP * i;   // PS: 4 or 2
  if (h0 + hh < g && i < NP) sm.sc[h0 + hh][kl] = rs + kl < n ? x * scale2 : NEG_INF;
}

// P.V of a round for the thread's first HN head slots (heads r + KP j; a slot past g computes with
// head 0 and is never written): acc[j] += sum over the round's keys k0 .. k1 - 1 of p[h][key] * V[key][its dims].
template <int HN, int HPT>
__device__ __forceinline__ void attn_pv(const AttnSmem& sm, float (&acc)[HPT][8], int k0, int k1, int D,
                                        int c, int C, int r, int KP, int g) {
  int hj[HN];
#pragma unroll
  for (int j = 0; j < HN; ++j) hj[j] = r + KP * j < g ? r + KP * j : 0;
  const float* vt = sm.u.vt;
#pragma unroll 4
  for (int kk = k0; kk < k1; ++kk) {
    const float4 v0 = *(const float4*)(vt + kk * D + 4 * c);
    const float4 v1 = *(const float4*)(vt + kk * D + 4 * (c + C));
#pragma unroll
    for (int j = 0; j < HN; ++j) {
      const float pk = sm.sc[hj[j]][kk];
      acc[j][0] = fmaf(pk, v0.x, acc[j][0]); acc[j][1] = fmaf(pk, v0.y, acc[j][1]);
      acc[j][2] = fmaf(pk, v0.z, acc[j][2]); acc[j][3] = fmaf(pk, v0.w, acc[j][3]);
      acc[j][4] = fmaf(pk, v1.x, acc[j][4]); acc[j][5] = fmaf(pk, v1.y, acc[j][5]);
      acc[j][6] = fmaf(pk, v1.z, acc[j][6]); acc[j][7] = fmaf(pk, v1.w, acc[j][7]);
    }
  }
}

// Combined output of float4 group idx (head idx / G4) of a KV head: the splits' partial sums weighted by
// sm.u.c.w over sm.l; xp: the group's first pf splits, already loaded; the rest CB splits' loads at a time.
template <int CB = 4>
__device__ __forceinline__ void combine_out(const AttnSmem& sm, const float4 (&xp)[ATT_PF], int pf,
                                            const float* pacc, int idx, int SU, int g, int G4, int gd,
                                            u16* out) {
  const int h = idx / G4;
  const float* w = sm.u.c.w;
  const float* pb = pacc + 4 * idx;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int u = 0; u < ATT_PF; ++u) {
    if (u < pf) {
      const float wt = w[u * g + h];
      o.x = fmaf(wt, xp[u].x, o.x); o.y = fmaf(wt, xp[u].y, o.y);
      o.z = fmaf(wt, xp[u].z, o.z); o.w = fmaf(wt, xp[u].w, o.w);
    }
  }
  int sp = pf;
  for (; sp + CB <= SU; sp += CB) {                        // CB splits' loads in flight
    float4 x[CB];
#pragma unroll
    for (int u = 0; u < CB; ++u) x[u] = ld_cg4(pb + (size_t)(sp + u) * gd);
#pragma unroll
    for (int u = 0; u < CB; ++u) {
      const float wt = w[(sp + u) * g + h];
      o.x = fmaf(wt, x[u].x, o.x); o.y = fmaf(wt, x[u].y, o.y);
      o.z = fmaf(wt, x[u].z, o.z); o.w = fmaf(wt, x[u].w, o.w);
    }
  }
  for (; sp < SU; ++sp) {
    const float4 x = ld_cg4(pb + (size_t)sp * gd);
    const float wt = w[sp * g + h];
    o.x = fmaf(wt, x.x, o.x); o.y = fmaf(wt, x.y, o.y);
    o.z = fmaf(wt, x.z, o.z); o.w = fmaf(wt, x.w, o.w);
  }
  const float l = sm.l[h];                                 // 0 with no keys: NaN out
  u16* ob = out + 4 * idx;
  ob[0] = f2h(o.x / l); ob[1] = f2h(o.y / l); ob[2] = f2h(o.z / l); ob[3] = f2h(o.w / l);
}

// One round of a split: keys [rs, rs + nk) (nk >= 1) from kq / vq, which are then reloaded with the rows
// of the round at next_rs (none when < 0); scores, online softmax (FC: two heads per warp at once), P.V.
// GR groups (ATT_GROUP): each makes the scores of its PS passes for HH = 16 / PS heads at a time and P.V
// over its passes' keys for every head; the groups' P.V sums are added at the split's end (attn_split).
template <bool FC, int GR>
__device__ __forceinline__ void attn_round(AttnSmem& sm, const AttnArgs& a, uint4 (&kq)[ATT_NP / GR],
                                           uint4 (&vq)[ATT_NP / GR], float (&acc)[ATT_HPT_OF(GR)][8], int rs, int nk,
                                           int n, int pp, int next_rs) {
  constexpr int NT = ATT_THREADS * GR, PS = ATT_NP / GR, HH = 16 / PS;
  ATT_GROUP(GR);
  const int tid = threadIdx.x, D = a.D, g = a.g, RK = a.RK, cpl = a.cpl, C = D >> 3, Cp = 1 << cpl;
  const int KP = ATT_THREADS >> cpl, NP = RK / KP;
  const int c = lt & (Cp - 1), r = lt >> cpl, warp = tid >> 5, lane = tid & 31;
  const int T = cpl < 4 ? cpl : 4, nv = 16 >> T;         // butterfly stages; values left per lane
  __syncthreads();                                      // the last round's P.V is done with vt, sc
  float kf[PS][8];
#pragma unroll
  for (int ii = 0; ii < PS; ++ii) {                    // K to floats, V rows into the tile
    const int i = grp * PS + ii, kl = r + KP * i, key = rs + kl;
    float vf[8];
    unpack8(kq[ii], kf[ii]);
    unpack8(vq[ii], vf);
    if (key == pp && c < C) {       // lanes past D keep attn_load's zeros (their q is 0, and 0 times the
#pragma unroll                      // stale shared memory past row p's D values can be NaN)
      for (int e = 0; e < 8; ++e) {
        kf[ii][e] = sm.kn[8 * c + e];
        vf[e] = sm.vn[8 * c + e];
      }
    }
    if (!(key < n)) {
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[ii][e] = vf[e] = 0.f;
    }
    if (i < NP && c < C) {
      float* vt = sm.u.vt + kl * D + 8 * c;
      *(float4*)vt = make_float4(vf[0], vf[1], vf[2], vf[3]);
      *(float4*)(vt + 4) = make_float4(vf[4], vf[5], vf[6], vf[7]);
    }
  }
  if (next_rs >= 0) attn_load<GR>(a, next_rs, kq, vq);   // a later round's rows, in flight meanwhile
  for (int h0 = 0; h0 < g; h0 += HH) {                  // scores, HH heads x PS key passes at a time
    float s[16];
#pragma unroll
    for (int hh = 0; hh < HH; ++hh) {
      float4 q0 = make_float4(0.f, 0.f, 0.f, 0.f), q1 = q0;
      if (h0 + hh < g && c < C) {
        q0 = *(const float4*)(sm.qs + (h0 + hh) * D + 8 * c);
        q1 = *(const float4*)(sm.qs + (h0 + hh) * D + 8 * c + 4);
      }
#pragma unroll
      for (int i = 0; i < PS; ++i)
        s[PS * hh + i] = q0.x * kf[i][0] + q0.y * kf[i][1] + q0.z * kf[i][2] + q0.w * kf[i][3] +
                         q1.x * kf[i][4] + q1.y * kf[i][5] + q1.z * kf[i][6] + q1.w * kf[i][7];
    }
    // transposing butterfly over the Cp lanes of a row: each stage halves the values a lane keeps
    int o = Cp >> 1;
    if (T > 0) { butterfly_stage<8>(s, c, o); o >>= 1; }
    if (T > 1) { butterfly_stage<4>(s, c, o); o >>= 1; }
    if (T > 2) { butterfly_stage<2>(s, c, o); o >>= 1; }
    if (T > 3) { butterfly_stage<1>(s, c, o); o >>= 1; }
    for (; o; o >>= 1) s[0] += __shfl_xor_sync(0xffffffffu, s[0], o);   // Cp = 32: one value left
    if ((c & ((1 << (cpl - T)) - 1)) == 0) {            // value j is (head h0 + v / PS, pass slot v % PS)
      const int base = nv * (c >> (cpl - T));
      if (nv == 1) {                                    // D >= 128: one value per lane
        put_score<PS>(sm, h0, base, s[0], g, NP, r, KP, rs, n, a.scale2, grp);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (j < nv) put_score<PS>(sm, h0, j + base, s[j], g, NP, r, KP, rs, n, a.scale2, grp);
      }
    }
  }
  __syncthreads();
  if (FC) {                                             // the same, two heads per warp at once
    for (int h = warp; h < g; h += 2 * (NT / 32)) {
      const int h2 = h + NT / 32;
      const bool two = h2 < g;
      const int hb = two ? h2 : h;                      // a row to read when there is no second head
      float v[ATT_MAXRK / 32], v2[ATT_MAXRK / 32], mx = NEG_INF, mx2 = NEG_INF;
#pragma unroll
      for (int i = 0; i < ATT_MAXRK / 32; ++i) {
        const int kk = lane + 32 * i;
        v[i] = kk < nk ? sm.sc[h][kk] : NEG_INF;
        v2[i] = kk < nk ? sm.sc[hb][kk] : NEG_INF;
        mx = fmaxf(mx, v[i]);
        mx2 = fmaxf(mx2, v2[i]);
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        mx2 = fmaxf(mx2, __shfl_xor_sync(0xffffffffu, mx2, o));
      }
      const float mo = sm.m[h], lo = sm.l[h], mo2 = sm.m[hb], lo2 = sm.l[hb];
      const float mn = fmaxf(mo, mx), mn2 = fmaxf(mo2, mx2);
      const float al = exp2f(mo - mn), al2 = exp2f(mo2 - mn2);
      float ls = 0.f, ls2 = 0.f;
#pragma unroll
      for (int i = 0; i < ATT_MAXRK / 32; ++i) {
        const int kk = lane + 32 * i;
        const float e = kk < nk ? exp2f(v[i] - mn) : 0.f, e2 = kk < nk ? exp2f(v2[i] - mn2) : 0.f;
        if (kk < nk) {
          sm.sc[h][kk] = e;
          if (two) sm.sc[h2][kk] = e2;
        }
        ls += e;
        ls2 += e2;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        ls += __shfl_xor_sync(0xffffffffu, ls, o);
        ls2 += __shfl_xor_sync(0xffffffffu, ls2, o);
      }
      __syncwarp();  // every lane's read of sm.m / sm.l before lane 0's write (the shuffles order no memory)
      if (lane == 0) {
        sm.m[h] = mn; sm.l[h] = fmaf(lo, al, ls); sm.al[h] = al;
        if (two) { sm.m[h2] = mn2; sm.l[h2] = fmaf(lo2, al2, ls2); sm.al[h2] = al2; }
      }
    }
  } else
  for (int h = warp; h < g; h += NT / 32) {              // online softmax, a warp per head
    float v[ATT_MAXRK / 32], mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < ATT_MAXRK / 32; ++i) {
      const int kk = lane + 32 * i;
      v[i] = kk < nk ? sm.sc[h][kk] : NEG_INF;
      mx = fmaxf(mx, v[i]);
    }
    const float mo = sm.m[h], lo = sm.l[h];
    const float mn = fmaxf(mo, warp_max(mx));           // finite: nk >= 1
    const float al = exp2f(mo - mn);                    // 0 on the first round
    float ls = 0.f;
#pragma unroll
    for (int i = 0; i < ATT_MAXRK / 32; ++i) {
      const int kk = lane + 32 * i;
      const float e = kk < nk ? exp2f(v[i] - mn) : 0.f;
      if (kk < nk) sm.sc[h][kk] = e;
      ls += e;
    }
    ls = warp_sum(ls);
    __syncwarp();
    if (lane == 0) { sm.m[h] = mn; sm.l[h] = fmaf(lo, al, ls); sm.al[h] = al; }
  }
  __syncthreads();
  if (c < C) {                                          // P.V of the round
#pragma unroll
    for (int j = 0; j < ATT_HPT_OF(GR); ++j) {
      const int h = r + KP * j;
      const float al = h < g ? sm.al[h] : 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[j][e] *= al;
    }
    const int hn = (g + KP - 1) / KP;                   // head slots in use: no per-key predicates
    const int k0 = grp * PS * KP, k1 = GR == 1 ? nk : min(nk, k0 + PS * KP);   // the group's keys
    constexpr int HPT = ATT_HPT_OF(GR);
    if (hn == 1) attn_pv<1, HPT>(sm, acc, k0, k1, D, c, C, r, KP, g);
    else if (hn == 2) attn_pv<2, HPT>(sm, acc, k0, k1, D, c, C, r, KP, g);
    else attn_pv<HPT, HPT>(sm, acc, k0, k1, D, c, C, r, KP, g);
  }
}

// Groups i0 and i1 (when has1) of combine_out together: xp0 / xp1 hold their first pf splits; the rest
// in batches of ATT_CB splits with both groups' loads in flight (the same sums, in the same order).
#define ATT_CB 8
__device__ __forceinline__ void combine_two(const AttnSmem& sm, const float4 (&xp0)[ATT_PF],
                                            const float4 (&xp1)[ATT_PF], int pf, const float* pacc, int i0,
                                            int i1, bool has1, int SU, int g, int G4, int gd, u16* out) {
  const int h0 = i0 / G4, h1 = has1 ? i1 / G4 : 0;
  const float* w = sm.u.c.w;
  float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
#pragma unroll
  for (int u = 0; u < ATT_PF; ++u) {
    if (u < pf) {
      const float w0 = w[u * g + h0], w1 = w[u * g + h1];
      o0.x = fmaf(w0, xp0[u].x, o0.x); o0.y = fmaf(w0, xp0[u].y, o0.y);
      o0.z = fmaf(w0, xp0[u].z, o0.z); o0.w = fmaf(w0, xp0[u].w, o0.w);
      o1.x = fmaf(w1, xp1[u].x, o1.x); o1.y = fmaf(w1, xp1[u].y, o1.y);
      o1.z = fmaf(w1, xp1[u].z, o1.z); o1.w = fmaf(w1, xp1[u].w, o1.w);
    }
  }
  for (int sp = pf; sp < SU; sp += ATT_CB) {
    float4 x0[ATT_CB], x1[ATT_CB];
#pragma unroll
    for (int u = 0; u < ATT_CB; ++u) {
      x0[u] = x1[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (sp + u < SU) {
        x0[u] = ld_cg4(pacc + (size_t)(sp + u) * gd + 4 * i0);
        if (has1) x1[u] = ld_cg4(pacc + (size_t)(sp + u) * gd + 4 * i1);
      }
    }
#pragma unroll
    for (int u = 0; u < ATT_CB; ++u) {
      if (sp + u < SU) {
        const float w0 = w[(sp + u) * g + h0], w1 = w[(sp + u) * g + h1];
        o0.x = fmaf(w0, x0[u].x, o0.x); o0.y = fmaf(w0, x0[u].y, o0.y);
        o0.z = fmaf(w0, x0[u].z, o0.z); o0.w = fmaf(w0, x0[u].w, o0.w);
        o1.x = fmaf(w1, x1[u].x, o1.x); o1.y = fmaf(w1, x1[u].y, o1.y);
        o1.z = fmaf(w1, x1[u].z, o1.z); o1.w = fmaf(w1, x1[u].w, o1.w);
      }
    }
  }
  const float l0 = sm.l[h0], l1 = sm.l[h1];               // 0 with no keys: NaN out
  u16* ob = out + 4 * i0;
  ob[0] = f2h(o0.x / l0); ob[1] = f2h(o0.y / l0); ob[2] = f2h(o0.z / l0); ob[3] = f2h(o0.w / l0);
  if (has1) {
    ob = out + 4 * i1;
    ob[0] = f2h(o1.x / l1); ob[1] = f2h(o1.y / l1); ob[2] = f2h(o1.z / l1); ob[3] = f2h(o1.w / l1);
  }
}

// The split's attention once sm.qs holds the queries (and sm.kn / sm.vn row pp when pp >= 0) and the
// threads are synchronised; kq / vq: the first round's loads; n = keys attended (0..n-1, n <= L);
// SA: the split blocks of this KV head that arrive here (the last of them combines; 1: none does).
// FC (fused_rope_attn_e): the softmax of two heads per warp at once; the arrival as cooperative groups'
// grid sync; the combine's weights in one step (two barriers fewer: a thread per head for <= 8 splits, a
// warp per head beyond, whose sums differ from the older order by fp32 rounding) and its loads in batches
// over both output groups (combine_two). (Two rounds' K/V loads in flight measured no faster: GPU run 2.)
// GR groups of threads (ATT_GROUP): the rounds split between them, their P.V sums added before the output.
template <bool FC, int GR>
__device__ __forceinline__ void attn_split(AttnSmem& sm, const AttnArgs& a, uint4 (&kq)[ATT_NP / GR],
                                           uint4 (&vq)[ATT_NP / GR], int n, int pp, int SA) {
  constexpr int NT = ATT_THREADS * GR;
  ATT_GROUP(GR);
  const int tid = threadIdx.x, kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
  const int D = a.D, g = a.g, RK = a.RK, cpl = a.cpl, C = D >> 3;
  const int KP = ATT_THREADS >> cpl, c = lt & ((1 << cpl) - 1), r = lt >> cpl;
  const int SK = a.R * RK, start = split * SK;
  const int rounds = n > start ? min(a.R, (n - start + RK - 1) / RK) : 0;
  if (tid < g) { sm.m[tid] = NEG_INF; sm.l[tid] = 0.f; }
  float acc[ATT_HPT_OF(GR)][8];
#pragma unroll
  for (int j = 0; j < ATT_HPT_OF(GR); ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
  if (!FC) {
    for (int rd = 0; rd < rounds; ++rd) {
      const int rs = start + rd * RK;
      attn_round<false, GR>(sm, a, kq, vq, acc, rs, min(RK, n - rs), n, pp, rd + 1 < rounds ? rs + RK : -1);
    }
  } else {
    for (int rd = 0; rd < rounds; ++rd) {
      const int rs = start + rd * RK;
      attn_round<true, GR>(sm, a, kq, vq, acc, rs, min(RK, n - rs), n, pp, rd + 1 < rounds ? rs + RK : -1);
    }
  }
  __syncthreads();                                        // sm.m / sm.l final (also with no rounds)
  const int gd = g * D;
  if (GR > 1) {                                           // group 1's P.V sums onto group 0's (through vt)
    if (grp == 1 && c < C)
#pragma unroll
      for (int j = 0; j < ATT_HPT_OF(GR); ++j) {
        const int h = r + KP * j;
        if (h < g) {
          float* t = sm.u.vt + h * D;
          *(float4*)(t + 4 * c) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
          *(float4*)(t + 4 * (c + C)) = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
        }
      }
    __syncthreads();
    if (grp == 0 && c < C)
#pragma unroll
      for (int j = 0; j < ATT_HPT_OF(GR); ++j) {
        const int h = r + KP * j;
        if (h < g) {
          const float4 t0 = *(const float4*)(sm.u.vt + h * D + 4 * c);
          const float4 t1 = *(const float4*)(sm.u.vt + h * D + 4 * (c + C));
          acc[j][0] += t0.x; acc[j][1] += t0.y; acc[j][2] += t0.z; acc[j][3] += t0.w;
          acc[j][4] += t1.x; acc[j][5] += t1.y; acc[j][6] += t1.z; acc[j][7] += t1.w;
        }
      }
  }
  if (SA == 1) {                                          // one split: normalise and write
#pragma unroll
    for (int j = 0; j < ATT_HPT_OF(GR); ++j) {
      const int h = r + KP * j;
      if (grp == 0 && h < g && c < C) {
        const float l = sm.l[h];                          // 0 with no keys: NaN out
        u16* o = a.out + (size_t)kvh * gd + h * D;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[4 * c + e] = f2h(acc[j][e] / l);
          o[4 * (c + C) + e] = f2h(acc[j][4 + e] / l);
        }
      }
    }
    return;
  }
  float* pacc = a.partials + (size_t)kvh * S * gd;                        // [S, g, D]
  float* pml = a.partials + (size_t)a.Hkv * S * gd + (size_t)kvh * S * g * 2;   // [S, g, 2]
  if (rounds > 0) {
#pragma unroll
    for (int j = 0; j < ATT_HPT_OF(GR); ++j) {
      const int h = r + KP * j;
      if (grp == 0 && h < g && c < C) {
        float* pp4 = pacc + (size_t)split * gd + h * D;
        *(float4*)(pp4 + 4 * c) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
        *(float4*)(pp4 + 4 * (c + C)) = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
      }
    }
    if (tid < g) {
      pml[((size_t)split * g + tid) * 2] = sm.m[tid];
      pml[((size_t)split * g + tid) * 2 + 1] = sm.l[tid];
    }
  }
  if (FC) {
    if (!arrive_last(&a.counters[kvh], SA, &sm.last)) return;
  } else {
    __threadfence();
    __syncthreads();
    if (tid == 0) sm.last = atomicAdd(&a.counters[kvh], 1) == SA - 1;
    __syncthreads();
    if (!sm.last) return;
    __threadfence();
  }
  const int SU = n > 0 ? min(S, (n + SK - 1) / SK) : 0;   // the splits with keys
  const int SG = SU * g;                                   // <= ATT_MAXW (the launcher's plan)
  const int G4 = D >> 2, NG = g * G4;                      // float4 groups of the KV head's output
  u16* out_kvh = a.out + (size_t)kvh * gd;
  float4 xp0[ATT_PF], xp1[ATT_PF];   // groups tid, tid + 128 of the first splits: loads in flight now
#pragma unroll
  for (int u = 0; u < ATT_PF; ++u) {
    xp0[u] = xp1[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (u < SU && tid < NG) xp0[u] = ld_cg4(pacc + (size_t)u * gd + 4 * tid);
    if (GR == 1 && u < SU && tid + NT < NG) xp1[u] = ld_cg4(pacc + (size_t)u * gd + 4 * (tid + NT));
  }
  float *w = sm.u.c.w, *wl = sm.u.c.wl;
  for (int i = tid; i < SG; i += NT) {                   // (max, sum) of every split: one latency
    w[i] = ld_cg(pml + 2 * i);
    wl[i] = ld_cg(pml + 2 * i + 1);
  }
  __syncthreads();
  if (FC) {
    if (SU > 8) {                                         // per head (a warp): max, weights, sum over lanes
      for (int h = tid >> 5; h < g; h += NT / 32) {
        const int lane = tid & 31;
        float mx = NEG_INF, l = 0.f;
        for (int sp = lane; sp < SU; sp += 32) mx = fmaxf(mx, w[sp * g + h]);
        mx = warp_max(mx);
        for (int sp = lane; sp < SU; sp += 32) {
          const float mi = w[sp * g + h], wgt = mi == NEG_INF ? 0.f : exp2f(mi - mx);
          w[sp * g + h] = wgt;
          l += wl[sp * g + h] * wgt;
        }
        l = warp_sum(l);
        if (lane == 0) sm.l[h] = l;
      }
    } else if (tid < g) {                                 // per head (a thread): the same, in sequence
      float mx = NEG_INF;
      for (int sp = 0; sp < SU; ++sp) mx = fmaxf(mx, w[sp * g + tid]);
      float l = 0.f;
      for (int sp = 0; sp < SU; ++sp) {
        const float mi = w[sp * g + tid], wgt = mi == NEG_INF ? 0.f : exp2f(mi - mx);
        w[sp * g + tid] = wgt;
        l += wl[sp * g + tid] * wgt;
      }
      sm.l[tid] = l;                                      // 0 with no keys: NaN out
    }
    __syncthreads();
    if (GR > 1) {                                         // one group per thread: loads 16 splits at a time
      for (int idx = tid; idx < NG; idx += NT)
        combine_out<16>(sm, xp0, idx == tid ? min(SU, ATT_PF) : 0, pacc, idx, SU, g, G4, gd, out_kvh);
    } else {
      if (tid < NG)
        combine_two(sm, xp0, xp1, min(SU, ATT_PF), pacc, tid, tid + NT, tid + NT < NG, SU, g,
                    G4, gd, out_kvh);
      for (int idx = tid + 2 * NT; idx < NG; idx += NT)
        combine_out(sm, xp0, 0, pacc, idx, SU, g, G4, gd, out_kvh);
    }
    if (tid == 0) a.counters[kvh] = 0;
    return;
  }
  if (tid < g) {
    float mx = NEG_INF;
    for (int sp = 0; sp < SU; ++sp) mx = fmaxf(mx, w[sp * g + tid]);
    sm.m[tid] = mx;
  }
  __syncthreads();
  for (int i = tid; i < SG; i += NT) {
    const float mi = w[i], wgt = mi == NEG_INF ? 0.f : exp2f(mi - sm.m[i % g]);
    w[i] = wgt;
    wl[i] *= wgt;
  }
  __syncthreads();
  if (tid < g) {
    float l = 0.f;
    for (int sp = 0; sp < SU; ++sp) l += wl[sp * g + tid];
    sm.l[tid] = l;                                         // 0 with no keys: NaN out
  }
  __syncthreads();
  if (tid < NG) combine_out(sm, xp0, min(SU, ATT_PF), pacc, tid, SU, g, G4, gd, out_kvh);
  if (tid + NT < NG) combine_out(sm, xp1, min(SU, ATT_PF), pacc, tid + NT, SU, g, G4, gd, out_kvh);
  for (int idx = tid + 2 * NT; idx < NG; idx += NT)
    combine_out(sm, xp0, 0, pacc, idx, SU, g, G4, gd, out_kvh);
  if (tid == 0) a.counters[kvh] = 0;
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    fused_decode_attn(const u16* q, const u16* k_store, const u16* v_store, const long long* pos,
                      int pos0, u16* out, float* partials, int* counters, int Hkv, int g, int D,
                      float scale2, int L, int RK, int R, int cpl) {
  pdl_trigger();
  pdl_wait();
  __shared__ __align__(16) AttnSmem sm;
  const AttnArgs a{k_store, v_store, out, partials, counters, Hkv, g, D, L, RK, R, cpl, scale2};
  uint4 kq[ATT_NP], vq[ATT_NP];
  attn_load<1>(a, blockIdx.y * R * RK, kq, vq);           // the first round, before the position
  const long long p = pos ? pos[0] : (long long)pos0;
  const int gd = g * D;
  const u16* qh = q + (size_t)blockIdx.x * gd;
  if (((size_t)qh & 15) == 0) {                           // 16-byte loads of the g queries
#pragma unroll 2
    for (int i = threadIdx.x; i < gd / 8; i += ATT_THREADS) {
      float f[8];
      unpack8(*(const uint4*)(qh + 8 * i), f);
      *(float4*)(sm.qs + 8 * i) = make_float4(f[0], f[1], f[2], f[3]);
      *(float4*)(sm.qs + 8 * i + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < gd; i += ATT_THREADS) sm.qs[i] = h2f(qh[i]);
  }
  const int n = (int)(p + 1 < (long long)L ? p + 1 : (long long)L);   // keys 0..p (<= 0: none)
  __syncthreads();
  attn_split<false, 1>(sm, a, kq, vq, n, -1, gridDim.y);
}

// q/k RMSNorm + RoPE + KV write + attention for one token in one launch: every split block makes
// its KV head's g queries (the same fp16-rounded values fused_qk_rope_kv writes); the block of the
// split holding p (the last split when p is past them all) makes K and V row p, writes them into the
// stores and uses them from shared memory (its first-round loads of row p are stale).
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    fused_rope_attn(const u16* qkv, const float* q_norm, const float* k_norm, const float* table,
                    int table_rows, const long long* pos, int pos0, u16* k_store, u16* v_store,
                    u16* out, float* partials, int* counters, int Hq, int Hkv, int D, int C, float eps,
                    float scale2, int L, int RK, int R, int cpl) {
  pdl_trigger();
  pdl_wait();
  __shared__ __align__(16) AttnSmem sm;
  const int kvh = blockIdx.x, warp = threadIdx.x >> 5, g = Hq / Hkv, SK = R * RK;
  const AttnArgs a{k_store, v_store, out, partials, counters, Hkv, g, D, L, RK, R, cpl, scale2};
  uint4 kq[ATT_NP], vq[ATT_NP];
  attn_load<1>(a, blockIdx.y * SK, kq, vq);               // the first round, before the position
  const int lane = threadIdx.x & 31;
  for (int h = warp; h <= g; h += ATT_THREADS / 32) {     // this warp's q rows (and the K row) into
    const u16* src = qkv + (size_t)(h == g ? Hq + kvh : kvh * g + h) * D;   // L1: one latency for all
    if (lane * 64 < D) asm volatile("prefetch.global.L1 [%0];" ::"l"(src + lane * 64));
  }
  const long long p = pos ? pos[0] : (long long)pos0;
  const bool ok = p >= 0 && p < C && p < table_rows;
  const long long ps = ok ? p / SK : 0;
  const bool writer = ok && (int)(ps < (long long)gridDim.y - 1 ? ps : gridDim.y - 1) == (int)blockIdx.y;
  const float* cs = table + (size_t)(ok ? p : 0) * 2 * D;
  for (int h = warp; h < g + (writer ? 1 : 0); h += ATT_THREADS / 32) {
    const bool kh = h == g;                               // the K head (writer only)
    rope_head<true>(qkv + (size_t)(kh ? Hq + kvh : kvh * g + h) * D, kh ? k_norm : q_norm, cs, D, eps,
                    ok, nullptr, kh ? sm.kn : sm.qs + h * D);
  }
  const u16* vsrc = qkv + (size_t)(Hq + Hkv + kvh) * D;
  if (writer)
    for (int i = threadIdx.x; i < D; i += ATT_THREADS) sm.vn[i] = h2f(vsrc[i]);
  __syncthreads();                                        // queries, sm.kn / sm.vn
  if (writer) {
    const size_t row = ((size_t)p * Hkv + kvh) * D;
    for (int i = threadIdx.x; i < D; i += ATT_THREADS) {
      k_store[row + i] = f2h(sm.kn[i]);
      v_store[row + i] = vsrc[i];
    }
  }
  const int n = ok ? (int)(p + 1 < (long long)L ? p + 1 : (long long)L) : 0;
  attn_split<false, 1>(sm, a, kq, vq, n, writer ? (int)p : -1, gridDim.y);
}

// fused_rope_attn_e: fused_rope_attn's outputs in fewer serial steps. Only the SU = ceil(n / SK) splits
// with keys run (the others return at once) and only they count into the combine; a lone split with keys
// writes the output itself. The heads: one per Cp = 2^cpl lanes (the attention's layout), lane c holds
// the pairs (i, i + D/2), i in [4c, 4c + 4), loaded 8 bytes at a time; the q rows and norm weights of the
// first two passes and the V row are loaded before the position is read, the RoPE row once for all
// passes. The writer (the split holding p; the last split with keys when p is past them) also makes the
// K head (head g of the passes) and writes K/V row p with 16-byte stores.
// GR thread groups (ATT_GROUP): fused_rope_attn_e one group, fused_rope_attn_w two (256 threads: the RoPE
// passes of twice the heads at once, each group half of a round's key passes).
#define ROPE_ATTN_ARGS const u16 *qkv, const float *q_norm, const float *k_norm, const float *table, \
    int table_rows, const long long *pos, int pos0, u16 *k_store, u16 *v_store, u16 *out, float *partials, \
    int *counters, int Hq, int Hkv, int D, int C, float eps, float scale2, int L, int RK, int R, int cpl
template <int GR>
__device__ __forceinline__ void rope_attn_e_body(ROPE_ATTN_ARGS) {
  constexpr int NT = ATT_THREADS * GR;
  pdl_trigger();
  pdl_wait();
  __shared__ __align__(16) AttnSmem sm;
  const int kvh = blockIdx.x, split = blockIdx.y, tid = threadIdx.x, g = Hq / Hkv, SK = R * RK;
  const AttnArgs a{k_store, v_store, out, partials, counters, Hkv, g, D, L, RK, R, cpl, scale2};
  uint4 kq[ATT_NP / GR], vq[ATT_NP / GR];
  attn_load<GR>(a, split * SK, kq, vq);                   // the first round, before the position
  const int c = tid & ((1 << cpl) - 1), hs = tid >> cpl, HP = NT >> cpl, half = D >> 1;
  const bool on = 8 * c < D;
  const u16* vsrc = qkv + (size_t)(Hq + Hkv + kvh) * D;
  const uint4 vrow = tid < (D >> 3) ? *(const uint4*)(vsrc + 8 * tid) : make_uint4(0u, 0u, 0u, 0u);
  uint2 xa[2], xb[2];                                     // passes 0, 1: head hs + HP u (g: the K head)
  float4 na[2], nb[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int h = hs + HP * u;
    xa[u] = xb[u] = make_uint2(0u, 0u);
    na[u] = nb[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (on && h <= g) {
      const u16* src = qkv + (size_t)(h < g ? kvh * g + h : Hq + kvh) * D;
      xa[u] = *(const uint2*)(src + 4 * c);
      xb[u] = *(const uint2*)(src + half + 4 * c);
      if (q_norm) {
        const float* nw = h < g ? q_norm : k_norm;
        na[u] = *(const float4*)(nw + 4 * c);
        nb[u] = *(const float4*)(nw + half + 4 * c);
      }
    }
  }
  const long long p = pos ? pos[0] : (long long)pos0;
  const bool ok = p >= 0 && p < C && p < table_rows;
  const int n = ok ? (int)(p + 1 < (long long)L ? p + 1 : (long long)L) : 0;
  const int SU = (n + SK - 1) / SK;                       // splits with keys (<= gridDim.y)
  if (SU == 0) {                                          // a bad position: NaN out, nothing written
    if (split == 0)
      for (int i = tid; i < g * D; i += NT) out[(size_t)kvh * g * D + i] = (u16)0x7e00;
    return;
  }
  if (split >= SU) return;
  const long long ps = p / SK;
  const bool writer = split == (ps < SU - 1 ? (int)ps : SU - 1);
  float4 ca = make_float4(0.f, 0.f, 0.f, 0.f), cb = ca, sa = ca, sb = ca;   // cos / signed sin of i, i + D/2
  if (on) {
    const float* cs = table + (size_t)p * 2 * D;
    ca = *(const float4*)(cs + 4 * c);
    cb = *(const float4*)(cs + half + 4 * c);
    sa = *(const float4*)(cs + D + 4 * c);
    sb = *(const float4*)(cs + D + half + 4 * c);
  }
  const int nh = g + (writer ? 1 : 0), passes = (nh + HP - 1) / HP;
  for (int u = 0; u < passes; ++u) {
    const int h = hs + HP * u;
    const bool act = on && h < nh;
    uint2 ra = u == 0 ? xa[0] : xa[1], rb = u == 0 ? xb[0] : xb[1];
    float4 wa = u == 0 ? na[0] : na[1], wb = u == 0 ? nb[0] : nb[1];
    if (u >= 2) {                                         // g + 1 > 2 HP: later heads loaded now
      ra = rb = make_uint2(0u, 0u);
      if (act) {
        const u16* src = qkv + (size_t)(h < g ? kvh * g + h : Hq + kvh) * D;
        ra = *(const uint2*)(src + 4 * c);
        rb = *(const uint2*)(src + half + 4 * c);
        if (q_norm) {
          const float* nw = h < g ? q_norm : k_norm;
          wa = *(const float4*)(nw + 4 * c);
          wb = *(const float4*)(nw + half + 4 * c);
        }
      }
    }
    float fa[4], fb[4];
    fa[0] = h2f((u16)(ra.x & 0xffffu)); fa[1] = h2f((u16)(ra.x >> 16));
    fa[2] = h2f((u16)(ra.y & 0xffffu)); fa[3] = h2f((u16)(ra.y >> 16));
    fb[0] = h2f((u16)(rb.x & 0xffffu)); fb[1] = h2f((u16)(rb.x >> 16));
    fb[2] = h2f((u16)(rb.y & 0xffffu)); fb[3] = h2f((u16)(rb.y >> 16));
    if (q_norm) {                                         // both norms or neither (the launcher)
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) ss = fmaf(fb[i], fb[i], fmaf(fa[i], fa[i], ss));
      for (int o = (1 << cpl) >> 1; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float rstd = rsqrtf(ss / (float)D + eps);
      fa[0] = fa[0] * rstd * wa.x; fa[1] = fa[1] * rstd * wa.y; fa[2] = fa[2] * rstd * wa.z; fa[3] = fa[3] * rstd * wa.w;
      fb[0] = fb[0] * rstd * wb.x; fb[1] = fb[1] * rstd * wb.y; fb[2] = fb[2] * rstd * wb.z; fb[3] = fb[3] * rstd * wb.w;
    }
    if (act) {
      const float c0[4] = {ca.x, ca.y, ca.z, ca.w}, c1[4] = {cb.x, cb.y, cb.z, cb.w};
      const float c2[4] = {sa.x, sa.y, sa.z, sa.w}, c3[4] = {sb.x, sb.y, sb.z, sb.w};
      float oa[4], ob[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        oa[i] = h2f(f2h(fmaf(fb[i], c2[i], fa[i] * c0[i])));
        ob[i] = h2f(f2h(fmaf(fa[i], c3[i], fb[i] * c1[i])));
      }
      float* dst = h < g ? sm.qs + h * D : sm.kn;
      *(float4*)(dst + 4 * c) = make_float4(oa[0], oa[1], oa[2], oa[3]);
      *(float4*)(dst + half + 4 * c) = make_float4(ob[0], ob[1], ob[2], ob[3]);
    }
  }
  if (writer && tid < (D >> 3)) {
    float vf[8];
    unpack8(vrow, vf);
    *(float4*)(sm.vn + 8 * tid) = make_float4(vf[0], vf[1], vf[2], vf[3]);
    *(float4*)(sm.vn + 8 * tid + 4) = make_float4(vf[4], vf[5], vf[6], vf[7]);
  }
  __syncthreads();                                        // queries, sm.kn / sm.vn
  if (writer && tid < (D >> 3)) {
    const size_t row = ((size_t)p * Hkv + kvh) * D + 8 * tid;
    const float* kf = sm.kn + 8 * tid;
    *(uint4*)(k_store + row) = make_uint4((u32)f2h(kf[0]) | ((u32)f2h(kf[1]) << 16),
                                          (u32)f2h(kf[2]) | ((u32)f2h(kf[3]) << 16),
                                          (u32)f2h(kf[4]) | ((u32)f2h(kf[5]) << 16),
                                          (u32)f2h(kf[6]) | ((u32)f2h(kf[7]) << 16));
    *(uint4*)(v_store + row) = vrow;
  }
  attn_split<true, GR>(sm, a, kq, vq, n, writer ? (int)p : -1, SU);
}

#define ROPE_ATTN_PASS qkv, q_norm, k_norm, table, table_rows, pos, pos0, k_store, v_store, out, partials, \
    counters, Hq, Hkv, D, C, eps, scale2, L, RK, R, cpl
extern "C" __global__ void __launch_bounds__(ATT_THREADS) fused_rope_attn_e(ROPE_ATTN_ARGS) {
  rope_attn_e_body<1>(ROPE_ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(2 * ATT_THREADS) fused_rope_attn_w(ROPE_ATTN_ARGS) {
  rope_attn_e_body<2>(ROPE_ATTN_PASS);
}

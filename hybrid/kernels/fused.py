"""Fused decode-step kernels (cuda/fused.cu): checked launchers, with torch references on CPU.

Legend: T tokens, H hidden, Hq / Hkv query / KV heads, D head_dim, g = Hq / Hkv, E experts,
k experts per token, R rows of the RoPE table, C rows of the KV store, L keys attended.

    x2, h, hf = add_rms_norm(x, w, eps, delta)   # x + delta.to(x.dtype); rms_norm -> h (+ fp32 copy)
    q = qk_rope_kv(qkv, q_norm, k_norm, table, k_store, v_store, Hq, Hkv, D, eps, pos=pos)
    ids, weights = route_topk(logits, k, renorm)  # softmax -> top-k -> renormalise
    ids, weights = router_topk(h, router, k, renorm)   # the router GEMV too (T <= 8)
    x2, h, ids, weights = add_norm_router(x, w, eps, router, k, renorm, delta)   # all of it (T <= 8)
    out = decode_attn(q, k_store, v_store, keys, pos=pos)   # one token, keys 0..pos
    out = rope_attn(qkv, q_norm, k_norm, table, k_store, v_store, Hq, Hkv, D, eps, keys, pos=pos)  # both
    rows = embed_rows(table, ids, dtype, table_ptr=p)    # table [V, H] where the card reads it (host too)

Each replaces several torch ops of the CUDA decode step with one launch on torch's current stream
(graph-capturable). On CPU tensors the reference functions (ref_*) run, which are the torch ops of
the unfused path. HYBRID_FUSED=0 turns the fused path off in the model (the torch ops, for A/B
measurements); HYBRID_FUSED=norm,rope,route,attn turns on only the parts named (rope_attn: q/k norm,
RoPE, KV write and attention of one token as one kernel instead of two).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from hybrid.kernels.driver import grow_workspace, ptr as _p
from hybrid.kernels.fused_build import KERNELS, force_ptx, module as _module  # noqa: F401
from hybrid.kernels.moe_route import RoutePlan
from hybrid.switches import OFF, env_choice

PARTS = ("norm", "rope", "route", "attn", "rope_attn")
ROUTE_MAX_E, ROUTE_MAX_K, ROUTER_MAX_T = 512, 32, 8
ANR_MAX_H = 8192          # add_norm_router keeps a normed row of H floats in shared memory
ROPE_MAX_D = 256
ATT_THREADS, ATT_MAX_G, ATT_MAX_Q = 128, 16, 2048   # threads per block, query heads per KV head, g * D
ATT_MAX_ROUND = 128       # keys per round of a split block (RK)
ATT_MAX_W = 1024          # splits x query heads of one KV head (the combine's shared memory)
ATT_COMBINE_Q = 131072    # tuning: at most this many floats of partials (splits x g x D) per combining block
ATT_PASSES = 4            # tuning (tools/gpu_attn_bench.py --sweep): key passes per round, 1..4
ATT_BLOCKS_PER_SM = 2.1   # tuning: split blocks per SM the plan aims at (2, with 5% slack before a round is added)
# H200, tools/gpu_attn_bench.py --sweep, sixteenth session (call 4): at each of the 8 measured points (32 query /
# 4 KV heads at 768 / 1280 / 2304 / 4352 / 8448 keys, 64 / 4 at 1280 / 4352 / 8448) the plan this gives is the
# fastest of the plans timed there; against the earlier 1 block per SM and 32768 floats it takes 1.00x / 0.90x /
# 0.88x / 0.84x / 0.78x the time with 32 / 4 heads and 0.82x / 0.67x / 0.53x with 64 / 4 (results/runtime.md 26)
ATT_MIN_ROUNDS = 1        # tuning: rounds per split at least (fewer splits, less combining, for few keys)
ATT_W_BLOCKS_PER_SM = 1.05   # tuning: the same for fused_rope_attn_w (256 threads, 163 registers: one per SM;
#   H200 call 3: 0.55 / 0.8 / 1.05 take 15.7 / 13.7 / 11.5 us at 2000 keys, 43.7 / 31.7 / 26.5 at 8000; 2.1, two
#   waves of blocks, 16.1 and 31.2); in the decode at the sm_90 carveout (hybrid.kernels.driver) 1.05 against 0.8:
#   410.9 vs 404.0 tok/s at 2000 keys, 369.8 vs 357.3 at 4000 (results/runtime.md 37.1). $HYBRID_ATT_W_PER_SM: A/B
ATT_HPT_W = 2             # fused_rope_attn_w's query heads per thread in P.V: ceil(g / (128 / 2^cpl)) at most
_DT = {torch.float16: 0, torch.float32: 1}


# The parts on when HYBRID_FUSED is unset: every part, the fastest set measured on the H200 (48
# 30B-A3B-shaped dense layers in one CUDA graph, tools/gpu_fused_ab.py --layers 48 --pos 300 3000,
# git 3ab1235, flash-decoding attention): at 512 keys every part 42.5 us per layer, norm+rope+route
# with torch's SDPA 49.4, torch ops 88.6; at 3072 keys 51.0 / 98.0 / 137.2 (SDPA 62.7 us per layer,
# fused_rope_attn 21.3). results/runtime.md.
DEFAULT_PARTS = frozenset(PARTS)


# Newer kernels beside the ones they may replace (cuda/fused.cu *_e): "norm" = fused_add_rms_norm_e
# (vectorised, every load at once), "router" = fused_add_norm_router_e
# (a block per expert, the norm made from one round of loads, a parallel top-k), "attn" = fused_rope_attn_e
# (only the splits with keys run; fewer serial loads). HYBRID_FUSED_NEW: unset = NEW_DEFAULT; 1/all; 0/none
# (the older kernels, kept for A/B); a comma list. Default: all three, measured on the H200 (GPU run 3,
# git 60fa019, tools/gpu_fused_kernels_ab.py, 48 launches per graph, us per launch old -> new): add+norm
# 2.42 -> 1.76; add+norm+router T=1 14.18 -> 7.38, T=8 65.5 -> 22.6 (ids equal); rope+attention at
# position 15 / 80 / 255 / 1000 / 2047 / 4095: 10.9 / 11.4 / 11.9 / 14.3 / 18.2 / 23.7 -> 6.0 / 8.9 / 9.5 /
# 12.5 / 15.6 / 21.0; the GPU tests (and, run 2, the runtime's greedy-id tests) passed. results/runtime.md 16.
# "plan": fused_add_norm_router_e also makes the grouped MoE kernels' routing when given a RoutePlan
# (hybrid.kernels.moe_route: qpn_moe's own route launch, 2.8 us per layer on the H200, is not made).
# "wide" (with "attn"): fused_rope_attn_w, fused_rope_attn_e's rounds shared by two groups of 128 threads (each
# group half of a round's key passes: its K/V loads, the scores of its keys for 8 heads at a time, P.V over its
# keys), where wide_fits, its plan one block per SM (ATT_W_BLOCKS_PER_SM). Default since the twenty-sixth
# session (H200, git 5745a1b / 48b85a2, results/runtime.md 36): per layer 4.9 / 7.3 / 9.0 / 11.5 / 16.5 / 26.5 us at 15 / 70 /
# 1000 / 2000 / 4000 / 8000 keys against fused_rope_attn_e's 5.4 / 7.9 / 13.3 / 17.7 / 22.2 / 30.9; decode of the
# synth 30B-A3B 476 vs 460 tok/s at a 32-token prompt, 395 vs 361 at 2000 (greedy ids equal).
NEW_PARTS = ("norm", "router", "attn", "plan", "wide")
NEW_DEFAULT: frozenset = frozenset(NEW_PARTS)


def _env_part(var: str, part: str, default) -> bool:
    """Whether environment switch `var` names `part`: unset = part in default; 1/on/all = every part;
    0/off/none = none; otherwise a comma list of parts."""
    v = os.environ.get(var, "").strip().lower()
    if v == "":
        return part in default
    if v in ("1", "on", "true", "yes", "all"):
        return True
    if v in OFF or v == "none":
        return False
    return part in {p.strip() for p in v.split(",")}


def new_kernel(part: str) -> bool:
    """HYBRID_FUSED_NEW (see NEW_PARTS): whether the newer kernel of `part` runs where it applies."""
    return _env_part("HYBRID_FUSED_NEW", part, NEW_DEFAULT)


# How the router's last block ranks a token's experts (fused_add_norm_router_e's `rank`, cuda/fused.cu RANK_*):
# "rounds" = the softmax over all E, then k rounds of a warp argmax by shuffles (what the compute_70 build always
# runs); "logits" = k rounds of two redux.sync each on the logits, each chosen weight exp(logit - top) (sm_80+;
# the same experts, weights within 2e-6). Default "logits": the router 1.19 us per layer faster on the H200 than the
# rounds (decode +2.1-2.5% at a 32-token prompt; results/runtime.md §39).
ROUTE_RANKS = {"rounds": 0, "logits": 1}
ROUTE_RANK_DEFAULT = "logits"


def route_rank() -> int:
    """$HYBRID_ROUTE_RANK (a ROUTE_RANKS name, default ROUTE_RANK_DEFAULT), read at each launch (A/B runs switch
    it; a CUDA session checks it when it opens) -> the kernel's rank argument."""
    return ROUTE_RANKS[env_choice("HYBRID_ROUTE_RANK", ROUTE_RANKS, ROUTE_RANK_DEFAULT)]


def _aligned(*ts) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def enabled(part: str) -> bool:
    """HYBRID_FUSED: unset = DEFAULT_PARTS; 1/on/all = every part; 0/off = none; a comma list = the
    parts named."""
    return _env_part("HYBRID_FUSED", part, DEFAULT_PARTS)


# ---------------------------------------------------------------------------- checks
def _launch(dev: torch.device, name: str, grid: tuple[int, int, int], block: int, args: list) -> None:
    """Kernel `name` of this card's fused module; a programmatic dependent launch where qpn.pdl says so
    (sm_90+, $HYBRID_PDL, on by default: each fused kernel waits for its predecessor at its start), decided
    by the target the module was built for (compute_70 PTX forced onto an sm_90 card has no wait in it)."""
    from hybrid.kernels.qpn import pdl

    mod = _module(dev)
    mod.launch(name, grid, block, args, pdl=pdl(mod.sm, "fused"))


def _dev(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _check(t, name: str, dtypes, shape: tuple, device: torch.device | None = None) -> None:
    if (type(t) is torch.Tensor and (t.dtype is dtypes or (type(dtypes) is tuple and t.dtype in dtypes))
            and t.shape == shape and (device is None or t.device == device) and t.is_contiguous()):
        return                                             # the common case, without building messages
    _explain(t, name, dtypes, shape, device)


def _explain(t, name: str, dtypes, shape: tuple, device) -> None:
    """The one-line error of _check (shape entries None match any size)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and _dev(t.device) != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _pos(pos: torch.Tensor | None, device: torch.device) -> None:
    if pos is not None:
        _check(pos, "pos", torch.int64, (1,), device)


# ---------------------------------------------------------------------------- residual + RMSNorm
def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU path of hybrid.model.layers.rms_norm: fp32 math, one cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def ref_add_rms_norm(x, weight, eps, delta=None, want_f32=False):
    if delta is not None:
        x = x + delta.to(x.dtype)
    h = ref_rms_norm(x, weight, eps)
    return x, h, (h.float() if want_f32 else None)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                 want_f32: bool = False):
    """x [T, H] fp16|fp32, weight [H] fp32, delta [T, H] fp16|fp32 or None ->
    (x + delta.to(x.dtype) (x itself when no delta), rms_norm(that) * weight in x's dtype,
    its fp32 copy [T, H] or None)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [T, H], got {list(x.shape)}")
    t, h = x.shape
    if not x.is_cuda:
        return ref_add_rms_norm(x, weight, eps, delta, want_f32)
    dev = _dev(x.device)
    _check(x, "x", (torch.float16, torch.float32), (t, h), dev)
    _check(weight, "weight", torch.float32, (h,), dev)
    if delta is not None:
        _check(delta, "delta", (torch.float16, torch.float32), (t, h), dev)
    x_out = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    hf = torch.empty(t, h, dtype=torch.float32, device=dev) if want_f32 else None
    if t:
        new = new_kernel("norm") and h % 4 == 0 and _aligned(x, delta, weight)
        _launch(dev, "fused_add_rms_norm_e" if new else "fused_add_rms_norm", (t, 1, 1), 256, [
            _p(x), _p(delta), _p(weight), _p(x_out if delta is not None else None), _p(out), _p(hf),
            ctypes.c_int(h), ctypes.c_float(eps), ctypes.c_int(_DT[x.dtype]),
            ctypes.c_int(_DT[delta.dtype] if delta is not None else 0)])
    return x_out, out, hf


# ---------------------------------------------------------------------------- embedding rows
_EMB = {torch.float16: 0, torch.float32: 1, torch.bfloat16: 2}      # fused.cu EMB_*


def ref_embed_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return table[ids.to(table.device)].to(dtype)


def embed_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, table_ptr: int | None = None) -> torch.Tensor:
    """ids [T] int64 -> table[ids] [T, H] in dtype (fp16 | fp32) on ids' device. table [V, H] fp16 | fp32 | bf16: on
    ids' card, or (table_ptr: its address in the card's address space) in pinned host memory mapped for the card,
    which the kernel reads over the bus (hybrid.runtime.host_embed). An id outside [0, V) gives a NaN row on a card
    (the device cannot raise); host ids run the reference."""
    if table.dim() != 2:
        raise ValueError(f"table: expected shape [V, H], got {list(table.shape)}")
    if not ids.is_cuda:
        return ref_embed_rows(table, ids, dtype)
    v, h = table.shape
    dev = _dev(ids.device)
    _check(ids, "ids", torch.int64, (ids.shape[0],), dev)
    if table.dtype not in _EMB or not table.is_contiguous():
        raise ValueError(f"table: expected a contiguous fp16/fp32/bf16 tensor, got {table.dtype}")
    if dtype not in _DT:
        raise ValueError(f"dtype: expected torch.float16 or torch.float32, got {dtype}")
    if table_ptr is None:
        if _dev(table.device) != dev:
            raise ValueError(f"table: on {table.device}, expected {dev} (or its mapped address as table_ptr)")
        table_ptr = table.data_ptr()
    out = torch.empty(ids.shape[0], h, dtype=dtype, device=dev)
    if ids.shape[0] and h:
        _launch(dev, "fused_embed_rows", (ids.shape[0], -(-h // 256), 1), 256, [
            ctypes.c_void_p(table_ptr), _p(ids), _p(out), ctypes.c_int(h), ctypes.c_longlong(v),
            ctypes.c_int(_EMB[table.dtype]), ctypes.c_int(_DT[dtype])])
    return out


# ---------------------------------------------------------------------------- q/k norm + RoPE + KV
def ref_rope(xf: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """xf [T, heads, D] fp32, cs [T, 2, D] (cos, signed sin) -> x * cos + swap_halves(x) * sin."""
    t, heads, d = xf.shape
    swapped = xf.view(t, heads, 2, d // 2).flip(2).reshape(t, heads, d)
    return torch.addcmul(xf * cs[:, None, 0], swapped, cs[:, None, 1])


def _positions(pos, start: int, t: int, device) -> torch.Tensor:
    base = pos.to(device, torch.int64) if pos is not None else torch.tensor([start], device=device)
    return base + torch.arange(t, device=device)


def ref_qk_rope_kv(qkv, q_norm, k_norm, table, k_store, v_store, n_heads, n_kv, head_dim, eps,
                   pos=None, start=0):
    """The torch ops of Attention._qk_rope + the KV writes of Attention.decode."""
    t, hq, hkv, d = qkv.shape[0], n_heads, n_kv, head_dim
    p = _positions(pos, start, t, qkv.device)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d).float()
    if q_norm is not None:
        w = torch.cat([q_norm.float().expand(hq, d), k_norm.float().expand(hkv, d)])
        qk = F.rms_norm(qk, (d,), None, eps) * w
    qk = ref_rope(qk, table.index_select(0, p)).to(qkv.dtype)
    k_store.index_copy_(0, p, qk[:, hq:].to(k_store.dtype))
    v_store.index_copy_(0, p, qkv[:, (hq + hkv) * d:].view(t, hkv, d).to(v_store.dtype))
    return qk[:, :hq].contiguous()


def qk_rope_kv(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               table: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, n_heads: int,
               n_kv: int, head_dim: int, eps: float, pos: torch.Tensor | None = None,
               start: int = 0) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] fp16 -> q [T, Hq, D] fp16 (q/k RMSNorm when q_norm/k_norm [D] fp32
    are given, RoPE from table [R, 2, D] fp32), and k, v written into k_store/v_store [C, Hkv, D]
    fp16 at rows p + t, p = pos [1] int64 on the device (graph-safe) or the host int start."""
    t, hq, hkv, d = qkv.shape[0], n_heads, n_kv, head_dim
    if not qkv.is_cuda:
        return ref_qk_rope_kv(qkv, q_norm, k_norm, table, k_store, v_store, hq, hkv, d, eps, pos, start)
    dev = _dev(qkv.device)
    if d % 2 or not 2 <= d <= ROPE_MAX_D:
        raise ValueError(f"head_dim: expected an even size <= {ROPE_MAX_D}, got {d}")
    _check_qkv(qkv, q_norm, k_norm, table, k_store, v_store, t, hq, hkv, d, dev)
    _pos(pos, dev)
    cap = k_store.shape[0]
    if pos is None and not (0 <= start and start + t <= min(cap, table.shape[0])):
        raise ValueError(f"positions {start}..{start + t - 1} outside the KV store ({cap} rows) "
                         f"or the RoPE table ({table.shape[0]} rows)")
    q = torch.empty(t, hq, d, dtype=torch.float16, device=dev)
    warps = t * (hq + 2 * hkv)
    if warps:
        _launch(dev, "fused_qk_rope_kv", (-(-warps // 4), 1, 1), 128, [
            _p(qkv), _p(q_norm), _p(k_norm), _p(table), ctypes.c_int(table.shape[0]), _p(pos),
            ctypes.c_int(start), _p(q), _p(k_store), _p(v_store), ctypes.c_int(t), ctypes.c_int(hq),
            ctypes.c_int(hkv), ctypes.c_int(d), ctypes.c_int(cap), ctypes.c_float(eps)])
    return q


def _check_qkv(qkv, q_norm, k_norm, table, k_store, v_store, t, hq, hkv, d, dev) -> None:
    _check(qkv, "qkv", torch.float16, (t, (hq + 2 * hkv) * d), dev)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: give both or neither")
    if q_norm is not None:
        _check(q_norm, "q_norm", torch.float32, (d,), dev)
        _check(k_norm, "k_norm", torch.float32, (d,), dev)
    _check(table, "table", torch.float32, (None, 2, d), dev)
    _check(k_store, "k_store", torch.float16, (None, hkv, d), dev)
    _check(v_store, "v_store", torch.float16, tuple(k_store.shape), dev)


# ---------------------------------------------------------------------------- router
def ref_route_topk(logits: torch.Tensor, k: int, renorm: bool):
    """The torch ops of hybrid.model.moe.route after the router GEMV."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def ref_route_outputs(ids, weights, slot_table=None, slots=None, row=None) -> None:
    """The runtime's ops after routing: slots [T*k] int32 = slot_table[ids]; row [T, 2k] fp32 =
    (ids as floats, weights)."""
    if slots is not None:
        slots.copy_(slot_table[ids.reshape(-1)])
    if row is not None:
        k = ids.shape[1]
        row[:, :k].copy_(ids)
        row[:, k:].copy_(weights)


def route_topk(logits: torch.Tensor, k: int, renorm: bool, slot_table: torch.Tensor | None = None,
               slots: torch.Tensor | None = None, row: torch.Tensor | None = None):
    """logits [T, E] fp32 -> (ids [T, k] int64, weights [T, k] fp32): softmax, top-k (descending,
    ties to the lowest id), divided by their sum when renorm. Optional outputs written in the same
    launch: slots [T*k] int32 = slot_table[ids] (slot_table [E] int32), row [T, 2k] fp32 = (ids as
    floats, weights)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [T, E], got {list(logits.shape)}")
    t, e = logits.shape
    if (slot_table is None) != (slots is None):
        raise ValueError("slot_table and slots: give both or neither")
    if not logits.is_cuda:
        ids, weights = ref_route_topk(logits, k, renorm)
        ref_route_outputs(ids, weights, slot_table, slots, row)
        return ids, weights
    dev = _dev(logits.device)
    _check(logits, "logits", torch.float32, (t, e), dev)
    _route_checks(t, e, k, dev, slot_table, slots, row, what="logits")
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    if t:
        _launch(dev, "fused_route_topk", (-(-t // 4), 1, 1), 128, [
            _p(logits), _p(ids), _p(weights), ctypes.c_int(t), ctypes.c_int(e), ctypes.c_int(k),
            ctypes.c_int(int(bool(renorm))), _p(slot_table), _p(slots), _p(row)])
    return ids, weights


def ref_router_topk(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool):
    """The torch ops of hybrid.model.moe.route: fp32 router GEMV, then ref_route_topk."""
    return ref_route_topk(h.float() @ router.float().T, k, renorm)


def router_topk(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool,
                slot_table: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                row: torch.Tensor | None = None):
    """h [T, H] fp16|fp32 (T <= 8), router [E, H] fp32 -> route_topk(h . router^T, ...) in one launch
    (the GEMV in fp32, summed in another order than cuBLAS: logits agree to fp32 rounding)."""
    if h.dim() != 2 or router.dim() != 2:
        raise ValueError(f"h, router: expected [T, H] and [E, H], got {list(h.shape)} and {list(router.shape)}")
    t, hd = h.shape
    e = router.shape[0]
    if (slot_table is None) != (slots is None):
        raise ValueError("slot_table and slots: give both or neither")
    if not h.is_cuda:
        ids, weights = ref_router_topk(h, router, k, renorm)
        ref_route_outputs(ids, weights, slot_table, slots, row)
        return ids, weights
    dev = _dev(h.device)
    _check(h, "h", (torch.float16, torch.float32), (t, hd), dev)
    _check(router, "router", torch.float32, (e, hd), dev)
    if not 1 <= t <= ROUTER_MAX_T or hd % 4:
        raise ValueError(f"h: expected 1..{ROUTER_MAX_T} tokens and H % 4 == 0, got {list(h.shape)}")
    _route_checks(t, e, k, dev, slot_table, slots, row)
    if h.data_ptr() % 16 or router.data_ptr() % 16:
        raise ValueError("h, router: data pointers must be 16-byte aligned")
    _, cnt = _workspace(dev, 0, 0)
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    _launch(dev, "fused_router_topk", (-(-e // 4), 1, 1), 128, [
        _p(h), ctypes.c_int(_DT[h.dtype]), _p(router), _p(logits), _p(cnt), ctypes.c_int(t), ctypes.c_int(e),
        ctypes.c_int(hd), ctypes.c_int(k), ctypes.c_int(int(bool(renorm))), _p(ids), _p(weights),
        _p(slot_table), _p(slots), _p(row)])
    return ids, weights


def _route_checks(t: int, e: int, k: int, dev, slot_table, slots, row, what: str = "router") -> None:
    """Expert count, k and the optional runtime outputs; `what` names the input that has the experts."""
    if not 1 <= e <= ROUTE_MAX_E:
        raise ValueError(f"{what}: at most {ROUTE_MAX_E} experts, got {e}")
    if not 1 <= k <= min(e, ROUTE_MAX_K):
        raise ValueError(f"k: expected 1..{min(e, ROUTE_MAX_K)}, got {k}")
    if slot_table is not None:
        _check(slot_table, "slot_table", torch.int32, (e,), dev)
        _check(slots, "slots", torch.int32, (t * k,), dev)
    if row is not None:
        _check(row, "row", torch.float32, (t, 2 * k), dev)


def add_norm_router(x: torch.Tensor, weight: torch.Tensor, eps: float, router: torch.Tensor, k: int,
                    renorm: bool, delta: torch.Tensor | None = None, slot_table: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None, row: torch.Tensor | None = None,
                    plan: RoutePlan | None = None):
    """add_rms_norm(x, weight, eps, delta) then router_topk(h, router, k, renorm, ...) in one launch
    (T <= 8) -> (x2, h, ids, weights). plan (with slots): the grouped MoE kernels' routing from the slot
    ids is also made (hybrid.kernels.moe_route; plan.made says whether it was: the block-per-expert
    kernel makes it for T * k <= 32, the older one does not)."""
    if x.dim() != 2 or router.dim() != 2:
        raise ValueError(f"x, router: expected [T, H] and [E, H], got {list(x.shape)} and {list(router.shape)}")
    t, hd = x.shape
    e = router.shape[0]
    if (slot_table is None) != (slots is None):
        raise ValueError("slot_table and slots: give both or neither")
    if plan is not None:
        if slots is None:
            raise ValueError("plan: needs slot_table and slots (the ids it groups)")
        plan.made = False
        plan.check(t * k, t, hd, plan.slots)
        if not new_kernel("plan") or not RoutePlan.fits(t, k):
            plan = None                                          # qpn_moe routes itself
    if not x.is_cuda:
        x2, h, _ = ref_add_rms_norm(x, weight, eps, delta)
        ids, weights = ref_router_topk(h, router, k, renorm)
        ref_route_outputs(ids, weights, slot_table, slots, row)
        if plan is not None:
            plan.fill_ref(slots)
        return x2, h, ids, weights
    dev = _dev(x.device)
    _check(x, "x", (torch.float16, torch.float32), (t, hd), dev)
    _check(weight, "weight", torch.float32, (hd,), dev)
    if delta is not None:
        _check(delta, "delta", (torch.float16, torch.float32), (t, hd), dev)
    _check(router, "router", torch.float32, (e, hd), dev)
    if not 1 <= t <= ROUTER_MAX_T or hd > ANR_MAX_H:
        raise ValueError(f"x: expected 1..{ROUTER_MAX_T} tokens of H <= {ANR_MAX_H}, got {list(x.shape)}")
    if hd % 4 == 0 and router.data_ptr() % 16:
        raise ValueError("router: data pointer must be 16-byte aligned")
    _route_checks(t, e, k, dev, slot_table, slots, row)
    _, cnt = _workspace(dev, 0, 0)
    x2 = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    args = [_p(x), _p(delta), _p(weight), _p(x2 if delta is not None else None), _p(h), ctypes.c_int(hd),
            ctypes.c_float(eps), ctypes.c_int(_DT[x.dtype]),
            ctypes.c_int(_DT[delta.dtype] if delta is not None else 0), _p(router), _p(logits), _p(cnt),
            ctypes.c_int(t), ctypes.c_int(e), ctypes.c_int(k), ctypes.c_int(int(bool(renorm))), _p(ids),
            _p(weights), _p(slot_table), _p(slots), _p(row)]
    if new_kernel("router") and hd % 4 == 0 and _aligned(x, delta, weight, router):
        name, grid = "fused_add_norm_router_e", e                # a block per expert
        if plan is not None:
            for part in ("offsets", "perm", "active"):
                b = getattr(plan, part)
                _check(b, f"plan.{part}", torch.int32, tuple(b.shape), dev)
            _check(plan.y, "plan.y", torch.float32, (t, hd), dev)
            if not _aligned(plan.y):
                raise ValueError("plan.y: data pointer must be 16-byte aligned")
        args += ([ctypes.c_int(plan.slots), _p(plan.offsets), _p(plan.perm), _p(plan.active), _p(plan.y),
                  ctypes.c_int(t * hd)] if plan is not None else
                 [ctypes.c_int(0), _p(None), _p(None), _p(None), _p(None), ctypes.c_int(0)])
        args.append(ctypes.c_int(route_rank()))
    else:
        name, grid = "fused_add_norm_router", -(-e // 4)         # a warp per expert; no plan
    _launch(dev, name, (grid, 1, 1), 128, args)
    if plan is not None and name == "fused_add_norm_router_e":
        plan.made = True
    return x2, h, ids, weights


# ---------------------------------------------------------------------------- decode attention
def ref_decode_attn(q, k_store, v_store, keys, pos=None, start=0):
    """One query token: softmax(q k^T / sqrt(D)) v over keys 0..p (fp32 math) -> [1, Hq * D]."""
    hq, d = q.shape[-2:]
    hkv = k_store.shape[1]
    p = int(pos.item()) if pos is not None else start
    kf = k_store[: p + 1].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)    # [Hq, n, D]
    vf = v_store[: p + 1].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
    s = (q.reshape(hq, 1, d).float() @ kf.transpose(1, 2)) / d ** 0.5                 # [Hq, 1, n]
    return (torch.softmax(s, -1) @ vf).reshape(1, hq * d).to(q.dtype)


_WORK: dict = {}


def _workspace(dev: torch.device, n: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device attention split partials (grow-only; older buffers are kept alive, captured graphs
    may point at them) and counters (zero, and left zero by every launch): [0] the router's, [1 + h]
    KV head h's. Launches on one device are ordered on one stream (as the runtime's are)."""
    return grow_workspace(_WORK, dev, max(n, 1), max(heads + 1, 65))


def decode_attn(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, keys: int,
                pos: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
    """q [1, Hq, D] fp16 at position p (pos [1] int64 on the device, or the host int start); keys
    0..p of k_store/v_store [C, Hkv, D] fp16, p < keys <= C (keys: the rows the launch covers, a
    bucket for graphs; a device p >= keys attends the first keys rows) -> attention output
    [1, Hq * D] fp16 (GQA: query head i reads KV head i // g). Flash-decoding: attn_plan splits."""
    if q.dim() != 3 or q.shape[0] != 1:
        raise ValueError(f"q: expected shape [1, Hq, D], got {list(q.shape)}")
    _, hq, d = q.shape
    if not q.is_cuda:
        return ref_decode_attn(q, k_store, v_store, keys, pos, start)
    dev = _dev(q.device)
    _check(q, "q", torch.float16, (1, hq, d), dev)
    _check(k_store, "k_store", torch.float16, (None, None, d), dev)
    _check(v_store, "v_store", torch.float16, tuple(k_store.shape), dev)
    _pos(pos, dev)
    hkv = k_store.shape[1]
    g, plan, part, cnt, out = _attn_setup("decode_attn", hq, hkv, d, keys, k_store, v_store, pos, start,
                                          keys, dev)
    splits, rounds, rk, cpl = plan
    _launch(dev, "fused_decode_attn", (hkv, splits, 1), ATT_THREADS, [
        _p(q), _p(k_store), _p(v_store), _p(pos), ctypes.c_int(start), _p(out), _p(part), _p(cnt[1:]),
        ctypes.c_int(hkv), ctypes.c_int(g), ctypes.c_int(d), ctypes.c_float(d ** -0.5 * _LOG2E),
        ctypes.c_int(keys), ctypes.c_int(rk), ctypes.c_int(rounds), ctypes.c_int(cpl)])
    return out


_LOG2E = 1.4426950408889634


def _attn_setup(what, hq, hkv, d, keys, k_store, v_store, pos, start, rows, dev, per_sm=None):
    """Shape checks of the one-token attention; -> (g, attn_plan(...), partials, counters,
    out [1, Hq*D])."""
    g = hq // hkv if hkv else 0
    if not hkv or hq % hkv or g > ATT_MAX_G or g * d > ATT_MAX_Q or d % 8 or d > ROPE_MAX_D:
        raise ValueError(f"{what}: Hq={hq}, Hkv={hkv}, D={d} not supported (Hq % Hkv == 0, "
                         f"Hq/Hkv <= {ATT_MAX_G}, Hq/Hkv * D <= {ATT_MAX_Q}, D % 8 == 0, D <= {ROPE_MAX_D})")
    cap = k_store.shape[0]
    if not 1 <= keys <= cap:
        raise ValueError(f"keys: expected 1..{cap} (rows of the KV store), got {keys}")
    if pos is None and not 0 <= start < rows:
        raise ValueError(f"start: expected 0..{rows - 1}, got {start}")
    if k_store.data_ptr() % 16 or v_store.data_ptr() % 16:
        raise ValueError("k_store / v_store: data pointers must be 16-byte aligned")
    plan = attn_plan(keys, hkv, g, d, _sm_count(dev), per_sm)
    splits = plan[0]
    part, cnt = _workspace(dev, hkv * splits * g * (d + 2) if splits > 1 else 0, hkv)
    return g, plan, part, cnt, torch.empty(1, hq * d, dtype=torch.float16, device=dev)


def _cpl(d: int) -> int:
    """log2 of the lanes per K/V row (16-byte chunks: 2^cpl >= D / 8)."""
    return max(0, (d // 8 - 1).bit_length())


def wide_fits(g: int, d: int) -> bool:
    """Whether fused_rope_attn_w takes this shape: at most ATT_HPT_W query heads per thread in P.V."""
    return -(-g // (ATT_THREADS >> _cpl(d))) <= ATT_HPT_W


def attn_w_per_sm() -> float:
    """ATT_W_BLOCKS_PER_SM, or $HYBRID_ATT_W_PER_SM (A/B runs: read at each launch, > 0; a CUDA session checks it
    when it opens)."""
    v = os.environ.get("HYBRID_ATT_W_PER_SM")
    if not v:
        return ATT_W_BLOCKS_PER_SM
    try:
        f = float(v)
    except ValueError:
        f = 0.0
    if not 0 < f <= 8:
        from hybrid.errors import HybridError

        raise HybridError(f"HYBRID_ATT_W_PER_SM={v!r}: expected blocks per SM, a number in (0, 8]")
    return f


def rope_attn_kernel(hq: int, hkv: int, d: int, aligned: bool = True) -> tuple[str, float | None]:
    """The kernel rope_attn launches for these heads under HYBRID_FUSED_NEW and the blocks per SM its plan aims
    at (None: ATT_BLOCKS_PER_SM); aligned: qkv, the norms and the table 16-byte aligned (the newer kernels' loads)."""
    new = new_kernel("attn") and aligned
    if new and new_kernel("wide") and hkv > 0 and hq % hkv == 0 and wide_fits(hq // hkv, d):
        return "fused_rope_attn_w", attn_w_per_sm()
    return ("fused_rope_attn_e" if new else "fused_rope_attn"), None


def attn_plan(keys: int, hkv: int, g: int, d: int, sms: int,
              per_sm: float | None = None) -> tuple[int, int, int, int]:
    """Split plan of the one-token attention (flash-decoding) for `keys` rows ->
    (splits S, rounds R per split, keys RK per round, cpl). A round is ATT_PASSES (<= 4) passes of
    KP = 128 / 2^cpl keys (2^cpl >= D / 8 lanes per row), at most 128 keys; the splits fill about
    ATT_BLOCKS_PER_SM blocks per SM over the Hkv heads, no more than the combine reads cheaply
    (S * g * D <= ATT_COMBINE_Q, S * g <= 1024); few keys take few splits (keys <= RK: one split).
    per_sm: the blocks per SM to aim at (default ATT_BLOCKS_PER_SM)."""
    cpl = _cpl(d)
    rk = min(max(1, min(ATT_PASSES, 4)) * (ATT_THREADS >> cpl), ATT_MAX_ROUND)
    chunks = -(-keys // rk)
    blocks = max(1, int(sms * (ATT_BLOCKS_PER_SM if per_sm is None else per_sm)))
    most = max(1, min(-(-blocks // hkv), ATT_COMBINE_Q // (g * d), ATT_MAX_W // g))
    rounds = max(-(-chunks // most), min(ATT_MIN_ROUNDS, chunks))
    return -(-chunks // rounds), rounds, rk, cpl


_SMS: dict = {}


def _sm_count(dev: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; tests may set _SMS[dev] to plan for fewer)."""
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def ref_rope_attn(qkv, q_norm, k_norm, table, k_store, v_store, n_heads, n_kv, head_dim, eps, keys,
                  pos=None, start=0):
    q = ref_qk_rope_kv(qkv, q_norm, k_norm, table, k_store, v_store, n_heads, n_kv, head_dim, eps, pos, start)
    return ref_decode_attn(q, k_store, v_store, keys, pos, start)


def rope_attn(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
              table: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, n_heads: int, n_kv: int,
              head_dim: int, eps: float, keys: int, pos: torch.Tensor | None = None,
              start: int = 0) -> torch.Tensor:
    """One token: qk_rope_kv then decode_attn in one launch. qkv [1, (Hq + 2 Hkv) * D] fp16 ->
    attention output [1, Hq * D] fp16; K/V row p written (p = pos [1] int64 or start)."""
    hq, hkv, d = n_heads, n_kv, head_dim
    if qkv.dim() != 2 or qkv.shape[0] != 1:
        raise ValueError(f"qkv: expected shape [1, (Hq + 2 Hkv) * D], got {list(qkv.shape)}")
    if not qkv.is_cuda:
        return ref_rope_attn(qkv, q_norm, k_norm, table, k_store, v_store, hq, hkv, d, eps, keys, pos, start)
    dev = _dev(qkv.device)
    _check_qkv(qkv, q_norm, k_norm, table, k_store, v_store, 1, hq, hkv, d, dev)
    _pos(pos, dev)
    cap = k_store.shape[0]
    name, per_sm = rope_attn_kernel(hq, hkv, d, _aligned(qkv, q_norm, k_norm, table))
    g, plan, part, cnt, out = _attn_setup("rope_attn", hq, hkv, d, keys, k_store, v_store, pos, start,
                                          min(keys, table.shape[0]), dev, per_sm)
    splits, rounds, rk, cpl = plan
    _launch(dev, name, (hkv, splits, 1), ATT_THREADS * (2 if name == "fused_rope_attn_w" else 1), [
        _p(qkv), _p(q_norm), _p(k_norm), _p(table), ctypes.c_int(table.shape[0]), _p(pos), ctypes.c_int(start),
        _p(k_store), _p(v_store), _p(out), _p(part), _p(cnt[1:]), ctypes.c_int(hq), ctypes.c_int(hkv),
        ctypes.c_int(d), ctypes.c_int(cap), ctypes.c_float(eps), ctypes.c_float(d ** -0.5 * _LOG2E),
        ctypes.c_int(keys), ctypes.c_int(rk), ctypes.c_int(rounds), ctypes.c_int(cpl)])
    return out


if __name__ == "__main__":                  # the build tool's entry: --emit DIR (see fused_build)
    from hybrid.kernels.fused_build import main

    main()

"""QPN launchers: checked entry points for the kernels in cuda/qpn.cu, with torch references on CPU.

Legend: M rows (tokens), N out, K in, T tokens, H hidden, I expert intermediate, S slots,
A routed assignments.
"""
from __future__ import annotations

import ctypes
import math
import functools
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.kernels import layout
from hybrid.kernels.driver import grow_workspace, ptr as _p
from hybrid.kernels.moe_route import RoutePlan
from hybrid.kernels.reference import ref_linear, ref_moe, ref_moe_planned
from hybrid.switches import env_choice

THREADS = 256
WARPS = 8
MAX_SLOTS = 1024
# M <= 8 linear kernel: None = the default (sm_80+ NVFP4 at M = 1: qpn2_linear_m1_as, scales applied
# per 8 groups in fp32; otherwise the register pipeline, measured at least as fast as the rings on
# the H200 for M = 2..8); "", "_u4" (deeper register pipeline), "_as", "_as4" (6- and 4-stage
# cp.async rings, sm_80+), "_m1", "_m1x2" (the M = 1 NVFP4 kernels, one or two tiles per warp; see
# linear_kernel), "_t2", "_t2u1" (register pipeline, two tiles per warp, 2 or 1 chunks per stage), "_tb1u4",
# "_tbu2" (TB_KERNELS: one or two tiles per warp fed by bulk async copies, sm_90+), "_m1seq" (qpn2_linear_m1_seq where
# seq_grid fits; use_seq): benchmark, tests.
LINEAR_VARIANT: list[str | None] = [None]
MOE_VARIANT: list[str | None] = [None]  # M <= 8 MoE kernels: None (default: "_as" on sm_80+), "" or "_as"
# M > PREFILL_MIN linear kernel: None = on sm_80+ the register-fragment GEMM (qpn{2,8}_gemmf_*,
# tile by gemmf_tile) or the shared-memory tiled WMMA GEMM (qpn{2,8}_gemm_*, tile by gemm_tile),
# whichever the H200 cost model (gemmf_cost vs gemm_us) says is faster, below sm_80 the WMMA GEMM;
# each split over K by gemm_splits; "wmma" = the WMMA GEMM on any device (the sm_80+ path before
# gemmf; A/B); "mt" = the 8-row-tile kernels (qpn{2,8}_linear_mt{2,4}, the path before
# that); "<BM>x<BN>" (one of GEMM_TILES) forces a WMMA tile, "f<BM>x<BN>" (one of GEMMF_TILES) a
# gemmf tile (below sm_80: the WMMA pick): benchmark, tests; initial value from
# $HYBRID_QPN_PREFILL (A/B runs of whole programs).
PREFILL_VARIANT: list[str | None] = [os.environ.get("HYBRID_QPN_PREFILL") or None]
PREFILL_MIN = 16
# sm_90 prefill (M > PREFILL_MIN): the wgmma GEMM of cuda/qpn_sm90.cu (hybrid.kernels.sm90) when
# PREFILL_VARIANT is "wgmma", and by default (SM90_DEFAULT; $HYBRID_QPN_SM90=0 turns it off) wherever
# its H200 cost model (sm90.cost_us) is below SM90_MARGIN x the gemmf / WMMA pick's (prefill_us).
# Measured on the H200 (device call 0206, results/cuda_kernels.md): with the margin, every (shape,
# format, M) of the 30 timed that takes it was faster than the gemmf / WMMA pick (lm_head, dense
# up/down at M = 64..512: 0.42-0.79x its time; q_proj M = 512, o_proj FP8 M = 512); the small
# attention shapes at M <= 128 stay on gemmf (within +-10% either way). Other devices ignore "wgmma".
SM90_DEFAULT = [os.environ.get("HYBRID_QPN_SM90", "1") != "0"]
SM90_MARGIN = 0.8
GEMM_TILES = ((128, 128), (64, 128), (64, 64), (32, 64))  # (BM rows of x, BN rows of W), largest first
MOE_GEMM_TILES = ((64, 128), (32, 128))  # (BM, BN) of the MoE prefill WMMA grouped GEMM (qpn_moe; see MOE_GEMM)


def variant(choice: str | None, sm: int) -> str:
    """The MoE kernel-name suffix for a variant choice on an sm_<sm> device (rings need sm_80+)."""
    if choice is None:
        return "_as" if sm >= 80 else ""
    return "" if choice.startswith("_as") and sm < 80 else choice


def linear_kernel(fmt: int, mt: int, m: int, sm: int, choice: str | None = None, n: int = 0, k: int = 0) -> str:
    """The kernel qpn_linear launches for M rows (N out features) in passes of mt 8-row tiles on an
    sm_<sm> device. From PAIR_MIN_TILES 16-row tiles on, a warp does two tiles (measured on the H200:
    lm_head NVFP4 M = 1 52.4 vs 55.3 us, M = 8 59.0 vs 67.3; dense_up M = 1 27.5 vs 30.0, M = 8 33.3 vs
    36.3; slower on 320 tiles; sm_80+ only, unmeasured on Volta): NVFP4 at M <= 4 on sm_90+ the bulk-ring
    column-trick kernel ct_tb_choice picks; otherwise (sm_80, or tb_mode not 1) NVFP4 at M = 1 on sm_80+
    qpn2_linear_m1_as2 (else qpn2_linear_m1_as), NVFP4 at 2 <= M <= MP_DEFAULT_MAX on sm_80+
    qpn2_linear_mp{2,4,8}_as2 (else _as); on sm_90+ FP8 and NVFP4 M = 5..8 (3..8 with tb_mode mt) below
    PAIR_MIN_TILES tiles qpn{fmt}_linear_mt1_tb1u4, from PAIR_MIN_TILES tiles FP8, and NVFP4 with
    K >= TB_PAIR_MIN_K, qpn{fmt}_linear_mt1_tbu2 (bulk-copy rings; see tb_mode), M <= 8 otherwise
    qpn{fmt}_linear_mt1_t2u1 (else qpn{fmt}_linear_mt1). choice "_m1" / "_m1x2" (M1_KERNELS) forces one of the
    M = 1 NVFP4 cp.async-ring kernels, "_mp" / "_mpx2" the column-trick ones, a TB_KERNELS or CT_TB_KERNELS suffix
    a bulk-ring kernel (sm_90+), where they apply (benchmark, tests). qpn_linear launches qpn2_linear_m1_seq before
    asking this (use_seq, seq_grid): "_m1seq" here is the default's pick. mt = 2, 4 (M > 8) on sm_90+: the bulk-ring
    kernels of MT 8-row tiles of x by default (tb_mode 1) or with a forced TB_KERNELS choice, else
    the register-pipeline qpn{fmt}_linear_mt{mt}."""
    if mt > 1 and sm >= 90 and (choice in TB_KERNELS or choice is None and tb_mode() == "1"):
        if mt == 4:          # one tile per warp (two spill)
            choice = "_tb1u4"
        elif choice is None:   # two tiles per warp on large grids or long rows
            choice = "_tbu2" if -(-n // 16) >= PAIR_MIN_TILES or k >= CT_U8_MIN_K else "_tb1u4"
        return f"qpn{fmt}_linear_mt{mt}{choice}"
    if mt != 1:
        return f"qpn{fmt}_linear_mt{mt}"
    if choice == "_m1seq":                       # qpn_linear launches it itself where it applies, else the default
        choice = None
    m1 = sm >= 80 and fmt == 2 and m == 1
    mp = sm >= 80 and fmt == 2 and 2 <= m <= 8
    if choice in M1_KERNELS:                     # forced where the M = 1 kernels apply, else the default
        if m1:
            return M1_KERNELS[choice]
        choice = None
    if choice in CT_TB_KERNELS:                  # forced where its M is on sm_90+ (NVFP4), else the default
        rows = ct_tb_m(choice)                   # an m1 kernel serves M = 1, an mp<MP> one M = 2..MP
        if fmt == 2 and sm >= 90 and (m == 1 if rows == 1 else 2 <= m <= rows):
            return ct_tb_name(choice)
        choice = None
    if choice in TB_KERNELS and sm < 90:         # the bulk-copy rings: sm_90+ only, else the default
        choice = None
    if choice in ("_mp", "_mpx2"):               # forced where the column-trick kernels apply, else the default
        if mp:
            pair = choice == "_mpx2" or -(-n // 16) >= PAIR_MIN_TILES
            return f"qpn2_linear_mp{mp_rows(m)}_as{'2' if pair else ''}"
        choice = None
    if choice is None:
        pair = sm >= 80 and -(-n // 16) >= PAIR_MIN_TILES   # measured on sm_90 only: Volta keeps one
        tb = tb_mode() if sm >= 90 else "0"
        if (m1 or mp) and tb == "1" and m <= CT_TB_MAX_M:
            return ct_tb_name(ct_tb_choice(m, pair, k))
        if m1:
            return "qpn2_linear_m1_as2" if pair else "qpn2_linear_m1_as"
        if mp and m <= MP_DEFAULT_MAX[0]:
            return f"qpn2_linear_mp{mp_rows(m)}_as{'2' if pair else ''}"
        if tb != "0" and (fmt == 8 or not pair or k >= TB_PAIR_MIN_K):
            return f"qpn{fmt}_linear_mt1{'_tbu2' if pair else '_tb1u4'}"
        return f"qpn{fmt}_linear_mt1_t2u1" if pair else f"qpn{fmt}_linear_mt1"
    name = f"qpn{fmt}_linear_mt1{'' if choice.startswith('_as') and sm < 80 else choice}"
    from hybrid.kernels.build import KERNELS

    if name not in KERNELS:   # a forced choice of another family that does not apply here, or a typo
        raise ValueError(f"LINEAR_VARIANT {choice!r}: no M <= 8 kernel {name} (format {fmt}, M = {m}, sm_{sm})")
    return name


PAIR_MIN_TILES = 1024  # 16-row tiles from which the M <= 8 kernels take two per warp
# Prefill of PREFILL_MIN < M <= TILE_PREFILL_MAX rows on sm_90+ (tb_mode 1, no PREFILL_VARIANT) through one pass of
# four 8-row tiles of x (qpn{2,8}_linear_mt4_tb1u4) instead of the tiled GEMMs, for weights below PAIR_MIN_TILES
# 16-row tiles. H200 (results/cuda_kernels.md, thirty-ninth session, call 2), M = 17 / 24 / 32, NVFP4 us: q_proj
# 10.4 / 11.9 / 15.5 vs 15.8 / 16.1 / 16.9, o_proj 10.4 / 11.1 / 13.3 vs 18.0 / 18.5 / 19.9, k_proj 7.5 / 7.8 / 8.1
# vs 11.7 / 12.0 / 13.0, expert gate_up 7.5 / 7.9 / 8.2 vs 12.1 / 12.8 / 13.5 (FP8 alike); not on large weights
# (lm_head M = 24: 172.7 vs 108.2 through wgmma; call 1), nor on a long-row one below PAIR_MIN_TILES tiles:
# dense_down (5120 x 25600) M = 24 110.4 vs 63.2 (call 4), hence the weight size too (q_proj's and o_proj's)
TILE_PREFILL_MAX = 32
TILE_PREFILL_MAX_WEIGHT = 4096 * 2048


def tile_prefill(m: int, n: int, k: int, sm: int, choice: str | None) -> bool:
    """Whether qpn_linear takes M > PREFILL_MIN rows of an N x K weight through the 8-row-tile kernels by default."""
    return (sm >= 90 and choice is None and PREFILL_MIN < m <= TILE_PREFILL_MAX and -(-n // 16) < PAIR_MIN_TILES
            and n * k <= TILE_PREFILL_MAX_WEIGHT and tb_mode() == "1")


# On sm_90+ with tb_mode 1, passes of MT = 2 (M = 9..16) or 4 8-row tiles of x go through the
# bulk-ring kernels (qpn{2,8}_linear_mt2_tbu2 / _tb1u4, qpn{2,8}_linear_mt4_tb1u4) instead of the register-pipeline
# qpn{2,8}_linear_mt{2,4}; a forced TB_KERNELS choice picks one of them at any MT. H200, M = 16 (results/
# cuda_kernels.md, thirty-ninth session, call 1; NVFP4 / FP8 us): two tiles per warp from PAIR_MIN_TILES tiles or
# CT_U8_MIN_K k -- lm_head 86.8 / 93.0 against 128.0 / 135.8 for mt2, dense_up 51.5 / 54.4 vs 70.7 / 83.6,
# dense_down 54.1 / 58.8 vs 77.9 / 74.7 -- else one: o_proj 9.2 / 10.5 vs 9.0 / 11.5, q_proj 9.2 / 9.6 vs 9.0 / 10.2,
# one expert's gate_up 6.7 / 7.2 vs 6.8 / 7.7. MT = 4 (tile_prefill, or PREFILL_VARIANT mt): M = 24 / 32 lm_head
# 172.7 / 203.4 vs 177.9 / 206.7, dense_up 99.2 / 136.4 vs 102.6 / 137.4 (FP8 98.9 / 131.9 vs 120.3 / 147.0)
M1_KERNELS = {"_m1": "qpn2_linear_m1_as", "_m1x2": "qpn2_linear_m1_as2"}  # LINEAR_VARIANT choices
PAIR_KERNELS = ("_m1_as2", "_mt1_t2", "_mt1_t2u1", "_mp2_as2", "_mp4_as2", "_mp8_as2")  # two tiles per warp (+ bulk NT 2)
# LINEAR_VARIANT choices: the M <= 8 kernels fed by bulk-copy rings (sm_90+), suffix -> (ST slots, U chunks per
# slot, NT tiles per warp) as qpn.cu's LINEAR_TB lines build them
TB_KERNELS = {"_tbu2": (2, 2, 2), "_tb1u4": (2, 4, 1)}
# LINEAR_VARIANT choices: the NVFP4 column-trick kernels for M = 1 ("_m1tb...") and M <= MP = 2, 4
# ("_mp<MP>tb...") fed by bulk-copy rings (sm_90+; qpn.cu's LINEAR_M1_TB / LINEAR_MP_TB lines), suffix -> (ST, U, NT)
# as in TB_KERNELS
CT_TB_KERNELS = {f"_{m}{v}": g for m in ("m1", "mp2", "mp4")
                 for v, g in (("tbu4", (2, 4, 1)), ("tbu8", (2, 8, 1)), ("tb2u4", (2, 4, 2)))
                 if (m, v) != ("mp4", "tbu8")}
CT_TB_MAX_M = 4   # the column-trick rings serve M = 1..CT_TB_MAX_M (M = 5..8: the 8-column kernels)


def ct_tb_name(suffix: str) -> str:
    """The kernel of a CT_TB_KERNELS suffix ("_m1tbu4" -> "qpn2_linear_m1_tbu4", "_mp2tb2u4" ->
    "qpn2_linear_mp2_tb2u4")."""
    return "qpn2_linear_" + suffix[1:].replace("tb", "_tb", 1)


def ct_tb_m(suffix: str) -> int:
    """The most rows a CT_TB_KERNELS kernel serves (1, or MP: M = 2..MP)."""
    return 1 if suffix.startswith("_m1") else int(suffix[3])


@functools.lru_cache(maxsize=None)
def bulk_geometry(name: str) -> tuple[int, int, int, int] | None:
    """(ST slots, U chunks per slot, NT tiles per warp, fp32 partials per tile per warp) of a bulk-ring linear kernel,
    else None."""
    for suffix, g in TB_KERNELS.items():
        for mt in (1, 2, 4):
            if name.endswith(f"_mt{mt}" + suffix):
                return (*g, 8 * mt * 16)
    for suffix, g in CT_TB_KERNELS.items():
        if name == ct_tb_name(suffix):
            return (*g, ct_tb_m(suffix) * 16)
    return None


def tiles_per_warp(name: str) -> int:
    """16-row tiles a warp of M <= 8 linear kernel `name` works on (its launch's work units are tile pairs when 2):
    PAIR_KERNELS and the bulk-ring kernels of NT = 2."""
    geo = bulk_geometry(name)
    return 2 if name.endswith(PAIR_KERNELS) or (geo is not None and geo[2] == 2) else 1


TB_ENV = "HYBRID_QPN_TB"
# NVFP4 from PAIR_MIN_TILES tiles takes the two-tile bulk ring (_tbu2) only with rows of at least this many k: H200,
# M = 3 / 4 / 6 / 8 (results/cuda_kernels.md, thirtieth session, call 9): dense_up (K 5120) 33.8 / 34.6 / 35.5 / 36.0
# vs 35.7 / 36.1 / 36.9 / 38.5 us with the register pipeline; lm_head (K 2048) 60.1 / 61.1 / 64.6 / 68.6 vs 61.0 /
# 61.7 / 62.9 / 64.5
TB_PAIR_MIN_K = 4096


def tb_mode() -> str:
    """$HYBRID_QPN_TB (default 1): on sm_90+ the M <= 8 kernels that the bulk-copy rings beat on the H200 are
    replaced by them -- FP8 at any M and NVFP4 at M = 3..8 below PAIR_MIN_TILES tiles by _tb1u4 (one tile per warp,
    two slots of 4 chunks), FP8 and NVFP4 with K >= TB_PAIR_MIN_K from PAIR_MIN_TILES tiles by _tbu2 (two tiles, two
    slots of 2 chunks), NVFP4 M = 1..4 by the column-trick rings ct_tb_choice picks; "mt" all but the last (NVFP4
    M = 1, 2 keep the cp.async column trick, M = 3, 4 take the 8-column rings), 0 none: the register-pipeline /
    cp.async kernels. Read at each launch (A/B runs switch it); HybridError naming the variable on anything else
    (checked when a CUDA session opens)."""
    return env_choice(TB_ENV, ("0", "1", "mt"), "1",
                      "1 (the bulk-copy ring kernels where faster), mt (not the NVFP4 M <= 4 column-trick ones) or 0 "
                      "(never)")


def ct_tb_choice(m: int, pair: bool, k: int) -> str:
    """The CT_TB_KERNELS suffix of NVFP4 at M = 1..4 on sm_90+ (pair: PAIR_MIN_TILES tiles or more). H200, against
    the cp.async column-trick kernels at M = 1, 2 and the 8-column bulk-ring kernels at M = 3, 4 (results/
    cuda_kernels.md, thirty-first session, calls 1-3). M = 1 and 2 (m1, mp2): below PAIR_MIN_TILES tiles one tile per
    warp in slots of 4 chunks (M = 1: o_proj 7.07 vs 7.81 us, k_proj 5.76 vs 6.03; M = 2: o_proj 7.26 vs 8.35), of 8
    from CT_U8_MIN_K k (dense_down M = 1 28.7 vs 30.4, M = 2 29.1 vs 31.6); from PAIR_MIN_TILES tiles two tiles per
    warp in slots of 4 with rows of TB_PAIR_MIN_K k or more (dense_up M = 1 27.4 vs 28.9, M = 2 27.8 vs 29.3), else
    one in slots of 8 (lm_head M = 1 50.6 vs 51.6, M = 2 51.3 vs 56.7). M = 3, 4 (mp4): two tiles in slots of 4 on
    large grids of long rows (dense_up M = 4 30.9 vs 34.7), else one in slots of 4 (lm_head 54.7 vs 62.1, dense_down
    31.1 vs 32.5, o_proj 7.4 vs 8.0; q_proj 7.8 vs 7.6, the one shape it loses)."""
    wide = pair and k >= TB_PAIR_MIN_K
    if m >= 3:
        return "_mp4" + ("tb2u4" if wide else "tbu4")
    rows = "_m1" if m == 1 else "_mp2"
    if pair:
        return rows + ("tb2u4" if wide else "tbu8")
    return rows + ("tbu8" if k >= CT_U8_MIN_K else "tbu4")


CT_U8_MIN_K = 8192


def tb_smem(suffix: str) -> int:
    """Dynamic shared memory of a bulk-ring kernel (a TB_KERNELS or CT_TB_KERNELS suffix, or a kernel name;
    qpn.cu's Smem for ST < 0, linear_m1_body's, linear_mp_body's): the WARPS rings of ST slots of NT x U x 576
    bytes (or the block's partial sums, if larger) and ST 8-byte mbarriers per warp."""
    if suffix in CT_TB_KERNELS:
        suffix = ct_tb_name(suffix)
    elif suffix in TB_KERNELS:
        suffix = "_mt1" + suffix
    st, u, nt, part = bulk_geometry(suffix)
    return max(WARPS * st * nt * u * 576, WARPS * nt * part * 4) + WARPS * st * 8


# NVFP4 at 2 <= M <= MP_DEFAULT_MAX on sm_80+: the column-trick kernels qpn2_linear_mp{2,4,8}_as{,2} (M = 1's
# scales in fp32 once per set of 8 / MP groups); above it the 8-column kernels; "_mp" forces them (M <= 8),
# "_mpx2" their two-tiles-per-warp form
MP_DEFAULT_MAX = [2]   # H200: M = 2 faster on lm_head, dense up/down, o_proj; M = 4, 8 mixed or slower


def mp_rows(m: int) -> int:
    """MP of the column-trick kernel for M rows: 2, 4 or 8 (columns = MP rows x 8 / MP groups)."""
    return 2 if m <= 2 else 4 if m <= 4 else 8


GEMM_MIN_KSTEPS = 4   # split-K: at least this many k-steps of 64 per split
GEMM_MAX_SPLITS = 16
# gemm_cost: shared-memory bytes of one SM that one byte of split-K partials (fp32, written and read
# back) costs; fit on the H200: q_proj M = 512, 2 splits took 8 us more than 1 (33.5 MB of partials)
# where 32 k-steps x 130 KB per SM took 46.4 us
GEMM_PART_COST = 0.02
# gemm_cost: per-SM time of two resident blocks of a 64-row tile against one, on the H200 (dense_down
# M = 64, 64x128: 6 splits, two blocks on most SMs, 104.5 us; 3 splits, one each, 119.4 us; the same
# k-steps per SM); 128 x 128 blocks (128 registers) gained nothing (q_proj M = 512)
GEMM_PAIR_RATE = 0.88
# split-K: the last block of an output tile reads every split's fp32 partial of it alone, so at most
# this many bytes of partials per tile (a 128x128 tile: 4 splits; 64x64: 16)
GEMM_MAX_PART_BYTES = 256 << 10
# shared-memory bytes one block moves per k-step of 64 (WMMA fragment loads of its 8 warps + the
# decoded stores): the tiled GEMM's bound on the H200 (128 B/clock/SM), so its per-k-step cost
GEMM_SMEM = {(128, 128): 130 << 10, (64, 128): 88 << 10, (64, 64): 64 << 10, (32, 64): 44 << 10}
# K splits of the tiled GEMM: None = gemm_splits' pick; an int forces that many (at most one per
# k-step): benchmark, tests.
PREFILL_SPLIT: list[int | None] = [None]


def gemm_tile(m: int, n: int, sms: int, choice: str | None = None, sm: int = 90,
              k: int = 4096) -> tuple[int, int]:
    """(BM, BN) of the tiled GEMM for M rows, N out features, K in features on an sm_<sm> device
    with `sms` SMs: of the tiles of at least 64 x 64 with BM no larger than M rounded up to a power
    of two (>= 64), the one of least gemm_cost, each with the K splits gemm_splits gives it.
    choice "<BM>x<BN>" forces one of GEMM_TILES. (sm: kept for per-architecture rules; the same
    tiles serve Volta and sm_80+.)"""
    if choice is not None:
        tile = tuple(int(v) if v.isdigit() else -1 for v in choice.split("x"))
        if tile not in GEMM_TILES:
            raise ValueError(f"PREFILL_VARIANT: expected one of "
                             f"{', '.join(f'{a}x{b}' for a, b in GEMM_TILES)} or 'mt', got {choice!r}")
        return tile
    cap = max(64, 1 << (m - 1).bit_length())
    fits = [(bm, bn) for bm, bn in GEMM_TILES if bm <= cap and bm * bn >= 64 * 64]
    return min(fits, key=lambda t: gemm_cost(m, n, t, sms, *gemm_splits(m, n, k, t, sms)))  # ties: larger


def gemm_cost(m: int, n: int, tile: tuple[int, int], sms: int, splits: int, ks: int) -> float:
    """Modelled time of a tiled-GEMM launch, in shared-memory bytes of the busiest SM: its blocks
    (ceil(blocks / SMs)) x ks k-steps x GEMM_SMEM (the double-buffered GEMM is bound by its SM's
    shared-memory bandwidth), x GEMM_PAIR_RATE where two or more blocks of a tile smaller than
    128 x 128 share an SM; when split, + the fp32 partials written and read back x GEMM_PART_COST
    + the partial tiles the last block of each output tile reads alone (splits x tile x 4 bytes)."""
    blocks = -(-m // tile[0]) * -(-n // tile[1]) * splits
    per_sm = -(-blocks // sms)
    cost = per_sm * ks * GEMM_SMEM[tile] * (GEMM_PAIR_RATE if per_sm > 1 and tile != (128, 128) else 1.0)
    if splits > 1:
        cost += splits * m * n * 8 * GEMM_PART_COST + splits * tile[0] * tile[1] * 4
    return cost


def gemm_splits(m: int, n: int, k: int, tile: tuple[int, int], sms: int,
                force: int | None = None, cost=None) -> tuple[int, int]:
    """(splits, KS): K splits of the tiled GEMM and k-steps of 64 per split (the last may be shorter):
    the split count of least cost (default gemm_cost; gemmf_cost for the sm_80+ kernels; ties:
    fewer), each split at least GEMM_MIN_KSTEPS k-steps, at most GEMM_MAX_SPLITS splits and
    GEMM_MAX_PART_BYTES of partials per output tile. force: that many splits (clamped to 1..k-steps)."""
    cost = cost or gemm_cost
    nk = -(-k // 64)
    if force is not None:
        ks = -(-nk // max(1, min(int(force), nk)))
        return -(-nk // ks), ks
    cap = max(1, min(GEMM_MAX_SPLITS, GEMM_MAX_PART_BYTES // (tile[0] * tile[1] * 4), nk // GEMM_MIN_KSTEPS))
    best = None
    for want in range(1, cap + 1):
        ks = -(-nk // want)
        splits = -(-nk // ks)
        c = cost(m, n, tile, sms, splits, ks)
        if best is None or c < best[0]:
            best = (c, splits, ks)
    return best[1], best[2]


# sm_80+ prefill GEMM qpn{2,8}_gemmf_<BM>x<BN> (weights decoded straight into the MMA's A fragments,
# activations through a cp.async ring): tile -> blocks resident per SM (registers; qpn.cu GEMMF)
GEMMF_TILES = {(128, 128): 1, (64, 256): 1, (64, 128): 2}
# The sm_80+ prefill cost model, in microseconds, least-squares fit (log error) on the 144 forced rows
# of H200 device call 3 (tools/gemm_probe.sh 93ed732: every gemmf tile and the WMMA pick at M = 64,
# 128, 512 on six shapes, NVFP4 and FP8; rms error 4.0%, worst 14%; tools/gemm_fit.py prints it):
# gemmf_cost / gemm_us = launch + busiest SM's k-steps x per-step time + per-wave block start
# + (split) counters' memset + partials written and read back + the last block's L2 round trips.
# gemmf: microseconds of one 64-k step of one block alone on an SM, per format (FP8 reads twice the
# bytes): 64x256 does the most MMA work per decoded weight and per B fragment loaded (~1.0 us per
# 2.1 MFLOP: ~270 TFLOP/s on the device); 128x128 (two ring stages, 160 registers) is the slowest
GEMMF_STEP_US = {(128, 128): {2: 1.25, 8: 1.29}, (64, 256): {2: 0.949, 8: 1.12}, (64, 128): {2: 0.703, 8: 0.811}}
GEMMF_PAIR_RATE = 0.756  # two resident blocks of a 2-per-SM tile: each step costs 2 x this x alone
GEMMF_BLOCK_US = 2.31    # per wave of blocks on an SM: ring fill, first weight loads, epilogue
# WMMA GEMM (gemm_cost's shared-memory bytes) in microseconds on the H200, per format (one block alone:
# 128x128 ~1.24 us per k-step; the 128 B/clock/SM bound would be 0.52: WMMA fragment loads do not
# reach it). Every WMMA tile runs two blocks per SM on sm_90 (128x128: 128 registers, 40 KB of shared
# memory), each step then x GEMM_US_PAIR_RATE (the forced rows: lm_head's 36 blocks per SM ~1.05 us
# per block-step, q_proj M = 512's one block per SM ~1.25; gemm_cost's rule leaves 128x128 unpaired)
GEMM_US_PER_BYTE = {2: 0.953e-5, 8: 0.992e-5}
GEMM_US_PAIR_RATE = 0.774
GEMM_BLOCK_US = 2.43     # per wave (two blocks per SM) for the WMMA GEMM
PREFILL_LAUNCH_US = 3.52  # a launch as CUDA events see it, queued behind a sleep
PREFILL_SPLIT_US = 4.06  # split-K: the arrival counters' memset launch
PREFILL_PART_US = 3.38e-7  # per byte of split-K partials written and read back (~3 TB/s)
PREFILL_TAIL_US = 0.263  # one L2 round trip of the last block's reduction (4 splits' partials at once)


def _split_us(m: int, n: int, splits: int, iters: int) -> float:
    """Split-K overhead: the counters' memset, the partials written and read back, and the last block
    of an output tile summing them: `iters` passes over its tile x ceil(splits / 4) L2 round trips."""
    if splits == 1:
        return 0.0
    return PREFILL_SPLIT_US + splits * m * n * 8 * PREFILL_PART_US + iters * -(-splits // 4) * PREFILL_TAIL_US


def gemmf_cost(m: int, n: int, tile: tuple[int, int], sms: int, splits: int, ks: int, fmt: int = 2) -> float:
    """Modelled microseconds of a gemmf launch on the H200 (fit above): launch + the busiest SM's
    blocks (ceil(blocks / SMs)) x ks k-steps x GEMMF_STEP_US, x GEMMF_PAIR_RATE where two share an
    SM, + GEMMF_BLOCK_US per wave of resident blocks; when split, _split_us (the last block's
    reduction passes over its tile BM / 8 times: 8 tokens x BN features each)."""
    blocks = -(-m // tile[0]) * -(-n // tile[1]) * splits
    per_sm = -(-blocks // sms)
    res = GEMMF_TILES[tile]
    cost = per_sm * ks * GEMMF_STEP_US[tile][fmt] * (GEMMF_PAIR_RATE if per_sm > 1 and res > 1 else 1.0)
    return (PREFILL_LAUNCH_US + cost + -(-blocks // (sms * res)) * GEMMF_BLOCK_US
            + _split_us(m, n, splits, tile[0] // 8))


def gemm_us(m: int, n: int, tile: tuple[int, int], sms: int, splits: int, ks: int, fmt: int = 2) -> float:
    """Modelled microseconds of a WMMA GEMM launch on the H200 (fit above; sm_80+ compares it with
    gemmf_cost): the busiest SM's blocks x ks x gemm_cost's k-step bytes x GEMM_US_PER_BYTE, x
    GEMM_US_PAIR_RATE where two share an SM (every tile: two resident), + GEMM_BLOCK_US per wave,
    launch, _split_us (the last block passes over its tile in 16 x 16 fragments, 8 per pass:
    (BM / 32) x (BN / 64) passes)."""
    blocks = -(-m // tile[0]) * -(-n // tile[1]) * splits
    per_sm = -(-blocks // sms)
    cost = per_sm * ks * GEMM_SMEM[tile] * GEMM_US_PER_BYTE[fmt] * (GEMM_US_PAIR_RATE if per_sm > 1 else 1.0)
    return (PREFILL_LAUNCH_US + cost + -(-blocks // (sms * 2)) * GEMM_BLOCK_US
            + _split_us(m, n, splits, (tile[0] // 32) * (tile[1] // 64)))


def _gemmf_cost_fn(fmt: int):
    return lambda m, n, tile, sms, splits, ks: gemmf_cost(m, n, tile, sms, splits, ks, fmt)


def gemmf_tile(m: int, n: int, k: int, sms: int, choice: str | None = None, fmt: int = 2) -> tuple[int, int]:
    """(BM, BN) of the sm_80+ GEMM: of GEMMF_TILES with BM no larger than M rounded up to a power of
    two (>= 64), the one of least gemmf_cost with the K splits gemm_splits gives it (ties: the
    first listed). choice "f<BM>x<BN>" forces a tile."""
    if choice is not None:
        tile = tuple(int(v) if v.isdigit() else -1 for v in choice[1:].split("x"))
        if tile not in GEMMF_TILES:
            raise ValueError(f"PREFILL_VARIANT: expected one of "
                             f"{', '.join(f'f{a}x{b}' for a, b in GEMMF_TILES)}, got {choice!r}")
        return tile
    cap = max(64, 1 << (m - 1).bit_length())
    fits = [t for t in GEMMF_TILES if t[0] <= cap]
    cost = _gemmf_cost_fn(fmt)
    return min(fits, key=lambda t: cost(m, n, t, sms, *gemm_splits(m, n, k, t, sms, cost=cost)))


@dataclass(frozen=True)
class GemmPlan:
    """A launch of the tiled GEMM: kernel name, grid (ceil(M/BM), ceil(N/BN), splits), KS."""

    kernel: str
    grid: tuple[int, int, int]
    ks: int

    @property
    def label(self) -> str:
        """Benchmark label: gemm_<BM>x<BN>, /s<splits> when split."""
        name = self.kernel.split("_", 1)[1]
        return name + (f"/s{self.grid[2]}" if self.grid[2] > 1 else "")


@functools.lru_cache(maxsize=4096)  # ~0.1 ms of model search per new (shape, M); the constants are fixed
def prefill_plan(fmt: int, m: int, n: int, k: int, sms: int, sm: int, choice: str | None = None,
                 split: int | None = None) -> GemmPlan | None:
    """The GEMM launch for M rows on an sm_<sm> device with `sms` SMs (None: M <= PREFILL_MIN or the
    'mt' variant: the 8-row-tile kernels). Default on sm_80+: the register-fragment GEMM (gemmf:
    gemmf_tile, its splits) or the shared-memory tiled WMMA GEMM (gemm_tile, its splits), whichever
    the H200 fit models faster (gemmf_cost vs gemm_us: WMMA where the launch is a few k-steps per
    block, e.g. one MoE expert at M <= 128, and on some large FP8 shapes); below sm_80 the WMMA GEMM.
    'wmma' or a forced WMMA tile: the WMMA GEMM; a forced gemmf tile: that tile (below sm_80: the
    WMMA pick)."""
    if m <= PREFILL_MIN or choice == "mt":
        return None
    if choice == "wgmma":   # sm_90 takes the wgmma GEMM before planning (use_sm90); elsewhere the default
        choice = None
    forced_f = choice is not None and choice.startswith("f")
    if forced_f:
        gemmf_tile(m, n, k, sms, choice)   # a valid name on every device
    fplan = fcost = None
    if sm >= 80 and (choice is None or forced_f):
        tile = gemmf_tile(m, n, k, sms, choice, fmt)
        cost = _gemmf_cost_fn(fmt)
        splits, ks = gemm_splits(m, n, k, tile, sms, force=split, cost=cost)
        fplan = GemmPlan(f"qpn{fmt}_gemmf_{tile[0]}x{tile[1]}", (-(-m // tile[0]), -(-n // tile[1]), splits), ks)
        if forced_f:
            return fplan
        fcost = cost(m, n, tile, sms, splits, ks)
    bm, bn = gemm_tile(m, n, sms, None if choice in ("wmma", None) or forced_f else choice, sm, k)
    splits, ks = gemm_splits(m, n, k, (bm, bn), sms, force=split)
    wplan = GemmPlan(f"qpn{fmt}_gemm_{bm}x{bn}", (-(-m // bm), -(-n // bn), splits), ks)
    if fplan is not None and fcost <= gemm_us(m, n, (bm, bn), sms, splits, ks, fmt):
        return fplan
    return wplan


# ---------------------------------------------------------------------------- weights
@dataclass
class QPNWeight:
    """One linear weight [N, K] ready for qpn_linear on `device`.

    CUDA: packed words (+ NVFP4 group scales) in the QPN layout and the folded global scale.
    CPU: the QWeight as stored (the reference dequantizes it transiently per call).
    Dense (F16/BF16/F32) weights are kept as fp16 [N, K] and use torch.matmul.
    """

    qtype: QType
    shape: tuple[int, int]
    device: torch.device
    words: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    gscale: float = 1.0
    qweight: QWeight | None = None
    dense: torch.Tensor | None = None
    name: str = ""

    @classmethod
    def from_qweight(cls, qw: QWeight, device) -> "QPNWeight":
        device = _device(device)
        n, k = qw.shape
        if not qw.qtype.is_quantized:
            return cls(qw.qtype, (n, k), device, dense=qw.data.to(device, torch.float16).contiguous(),
                       name=qw.name)
        layout.check_shape(qw.qtype, n, k, qw.name or "weight")
        if device.type != "cuda":
            return cls(qw.qtype, (n, k), device, qweight=qw.to(device), name=qw.name)
        q = qw.to(device)
        if qw.qtype is QType.NVFP4:
            words, scales = layout.pack_nvfp4(q)
        else:
            words, scales = layout.pack_fp8(q), torch.zeros(16, dtype=torch.uint8, device=device)
        return cls(qw.qtype, (n, k), device, words, scales, layout.global_scale(qw), name=qw.name)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (packed weights + scales, or the stored/dense tensors)."""
        if self.dense is not None:
            return self.dense.numel() * 2
        if self.qweight is not None:
            return self.qweight.nbytes
        return _nbytes(self.words) + (_nbytes(self.scales) if self.qtype is QType.NVFP4 else 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _device(device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


# ---------------------------------------------------------------------------- validation
def _check_tensor(t, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if _device(t.device) != device:
        raise ValueError(f"{name}: on {t.device}, but the weights are on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")
    if t.device.type == "cuda" and t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned")


# ---------------------------------------------------------------------------- launch helpers
def _mt(m_rows: int, sm: int) -> int:
    """8-row tiles per pass: 1 for M <= 8 (decode / speculative verify), more for prefill."""
    if m_rows <= 8:
        return 1
    if sm < 75 or m_rows <= 16:
        return 2
    return 4


def _pick_ks(units: int, chunks: int, sms: int) -> int:
    """Warps splitting K (1..8). Big problems: warp work items of at least 16 chunks (fewer
    per-item prologues and block reductions; on the H200, lm_head NVFP4 at M = 8 ran 7% faster with
    2 warps per tile than with 4, FP8 at M = 1 5% with 4 than with 8); small problems: enough warps
    to fill the GPU."""
    ks = 1
    while ks < WARPS:
        per = chunks // (2 * ks)
        if (per >= 16 and units * ks < sms * 400) or (per >= 2 and units * ks < sms * 32):
            ks *= 2
        else:
            break
    return ks


# _linear_ks: fixed cost of one warp's work item (ring fill, block reduction) in chunks of K
KS_ITEM_CHUNKS = 1.5


def _linear_ks(units: int, chunks: int, sms: int, per_sm: int) -> int:
    """Warps splitting K (1, 2, 4, 8) for an M <= 8 linear kernel of `units` warp work units over
    `chunks` chunks of K, `per_sm` resident blocks per SM: the most balanced launch. Score = wave
    fill (blocks / (sms x per_sm), over its ceiling: the last partial wave, or a single partial one,
    reads at the share of the GPU it occupies) x chunks per warp / (chunks per warp +
    KS_ITEM_CHUNKS). Fit on 80 forced-KS H200 rows (tools/qpn_grid_probe.py: lm_head, dense
    up/down, q_proj; NVFP4/FP8; M = 1, 8; each kernel): the pick is the measured best on 72, within
    5.4% on the rest (lm_head NVFP4 M = 1: 49.9 us vs 53.4 with _pick_ks; dense_up FP8 37.9 vs 40.8)."""
    best, best_score = 1, -1.0
    for ks in (1, 2, 4, 8):
        per = chunks / ks
        if chunks // ks < 2:
            break
        blocks = -(-units // (WARPS // ks))
        waves = blocks / (sms * per_sm)
        score = waves / math.ceil(waves) * per / (per + KS_ITEM_CHUNKS)
        if score > best_score * 1.0001:
            best, best_score = ks, score
    return best


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _module(device: torch.device):
    from hybrid.kernels.build import module

    return module(device, _FORCE_PTX.get(device.index))


_FORCE_PTX: dict[int, int] = {}


def force_ptx(device, sm: int | None) -> None:
    """Tests: run this device's kernels from compute_<sm> PTX through the driver JIT (None: native)."""
    d = _device(device)
    if sm is None:
        _FORCE_PTX.pop(d.index, None)
    else:
        _FORCE_PTX[d.index] = sm


def _fmt(qtype: QType) -> int:
    return 2 if qtype is QType.NVFP4 else 8


# ---------------------------------------------------------------------------- linear
def qpn_linear(x: torch.Tensor, w: QPNWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] fp16 = x[M, K] fp16 . W^T. CUDA: the QPN kernel; CPU: torch reference.

    out: optional fp16 [M, N] buffer the CUDA kernel writes into (every element is written)."""
    if not isinstance(w, QPNWeight):
        raise ValueError(f"w: expected a QPNWeight, got {type(w).__name__}")
    n, k = w.shape
    _check_tensor(x, "x", torch.float16, (None, k), w.device)
    m = x.shape[0]
    if out is not None:
        _check_tensor(out, "out", torch.float16, (m, n), w.device)
    if w.dense is not None or w.device.type != "cuda":
        y = _linear_torch(x, w)
        return y if out is None else out.copy_(y)
    y = torch.empty(m, n, dtype=torch.float16, device=w.device) if out is None else out
    if m == 0:
        return y
    mod = _module(w.device)
    fmt, sms = _fmt(w.qtype), _sms(w.device)
    kind, what = linear_route(mod, fmt, m, n, k, sms, w.scales.data_ptr() % 16 == 0)
    if kind == "wgmma":
        from hybrid.kernels import sm90

        return sm90.linear(x, w, y)
    if kind == "gemm":
        _launch_gemm(mod, what, w, x, y)
        return y
    if kind == "seq":
        args = [_p(w.words), _p(w.scales), ctypes.c_float(w.gscale), _p(x), _p(y), ctypes.c_int(n),
                ctypes.c_int(k), ctypes.c_int(what[0])]
        mod.launch(SEQ_NAME, (what[1], 1, 1), THREADS, args, smem=SEQ_SMEM, pdl=pdl(mod.sm))
        return y
    name = what
    passes = -(-m // (8 * _mt(m, mod.sm)))
    tiles = -(-n // 16)
    chunks = k // layout.CHUNK[w.qtype]
    geo = bulk_geometry(name)
    smem = tb_smem(name) if geo else 0
    units = -(-tiles // tiles_per_warp(name))   # warp work units
    ks = (_linear_ks(units, chunks, sms, mod.occupancy(name, THREADS, smem)) if passes == 1
          else _pick_ks(units * passes, chunks, sms))
    grid = (-(-units // (WARPS // ks)) * passes, 1, 1)
    args = [_p(w.words), _p(w.scales), ctypes.c_float(w.gscale), _p(x), _p(y), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(ks), ctypes.c_int(passes)]
    mod.launch(name, grid, THREADS, args, smem=smem, pdl=pdl(mod.sm))
    return y


def linear_route(mod, fmt: int, m: int, n: int, k: int, sms: int, aligned: bool = True) -> tuple[str, object]:
    """What qpn_linear launches for M rows of an N x K weight on mod's device (aligned: the weight's scales 16-byte
    aligned, as the bulk copies read them): ("wgmma", None) the sm_90 GEMM, ("gemm", GemmPlan) the tiled GEMM,
    ("seq", (B0, grid)) qpn2_linear_m1_seq, or ("linear", name) an 8-row-tile kernel (hybrid-bench's kernel column)."""
    tiled = tile_prefill(m, n, k, mod.sm, PREFILL_VARIANT[0])
    if m > PREFILL_MIN and not tiled and use_sm90(mod.sm, PREFILL_VARIANT[0], fmt, m, n, k, sms):
        return "wgmma", None
    plan = None if tiled else prefill_plan(fmt, m, n, k, sms, mod.sm, PREFILL_VARIANT[0], PREFILL_SPLIT[0])
    if plan is not None:
        return "gemm", plan
    mt = _mt(m, mod.sm)
    if aligned:
        geo = seq_plan(mod, fmt, m, -(-n // 16), k // layout.CHUNK[QType.NVFP4 if fmt == 2 else QType.FP8], sms)
        if geo is not None:
            return "seq", geo
    name = linear_kernel(fmt, mt, m, mod.sm, LINEAR_VARIANT[0], n, k)
    geo = bulk_geometry(name)
    if geo and not aligned:   # the bulk-ring kernels: the cp.async / register-pipeline ones instead
        pair = "2" if geo[2] == 2 else ""
        name = (f"qpn2_linear_m1_as{pair}" if "_m1_" in name else f"qpn2_linear_mp2_as{pair}" if "_mp2_" in name
                else f"qpn{fmt}_linear_mt{mt}" if mt > 1 else f"qpn{fmt}_linear_mt1{'_t2u1' if pair else ''}")
    return "linear", name


# NVFP4 M = 1 on sm_90+ for a weight of at least two tiles per warp of a wave (lm_head): qpn2_linear_m1_seq, whose
# first wave's warps stream two tiles each through one bulk ring, then one tile per warp. H200, lm_head NVFP4 M = 1
# (results/cuda_kernels.md, thirty-seventh session, 5 rounds alternating): 46.42-46.51 us (84.6-84.7% of the read)
# against 49.97-50.42 for ct_tb_choice's qpn2_linear_m1_tbu8, the same bits (one warp per tile in both, the same sums)
SEQ_ENV = "HYBRID_QPN_SEQ"
SEQ_NAME = "qpn2_linear_m1_seq"
SEQ_U = 8                                     # chunks per ring slot (qpn.cu's linear_m1_seq_body<8>)
SEQ_SMEM = WARPS * 2 * SEQ_U * 576 + WARPS * 16   # two slots per warp, then two 8-byte mbarriers per warp


def seq_mode() -> str:
    """$HYBRID_QPN_SEQ (default 1): on sm_90+ with tb_mode 1, NVFP4 at M = 1 on a weight of at least two tiles per
    warp of a wave (seq_grid) runs qpn2_linear_m1_seq; 0 keeps ct_tb_choice's kernel there. Read at each launch (A/B
    runs switch it); HybridError naming the variable on anything else (checked when a CUDA session opens)."""
    return env_choice(SEQ_ENV, ("0", "1"), "1", "1 (the two-tile first wave where it applies) or 0 (never)")


def use_seq(fmt: int, m: int, sm: int, choice: str | None) -> bool:
    """Whether qpn_linear launches qpn2_linear_m1_seq where seq_grid says it fits: NVFP4 at M = 1 on sm_90+, by
    default (tb_mode 1 and seq_mode 1) or forced (LINEAR_VARIANT "_m1seq"); any other forced choice keeps its own."""
    if fmt != 2 or m != 1 or sm < 90:
        return False
    return choice == "_m1seq" or (choice is None and tb_mode() == "1" and seq_mode() == "1")


def seq_plan(mod, fmt: int, m: int, tiles: int, chunks: int, sms: int) -> tuple[int, int] | None:
    """(B0, grid) of the qpn2_linear_m1_seq launch qpn_linear makes for M rows of a weight of `tiles` tiles x `chunks`
    chunks on mod's device (use_seq, then seq_grid at the kernel's occupancy there), else None."""
    if not use_seq(fmt, m, mod.sm, LINEAR_VARIANT[0]):
        return None
    return seq_grid(tiles, chunks, sms, mod.occupancy(SEQ_NAME, THREADS, SEQ_SMEM))


def seq_grid(tiles: int, chunks: int, sms: int, per_sm: int) -> tuple[int, int] | None:
    """(B0, grid) of qpn2_linear_m1_seq for `tiles` 16-row tiles of `chunks` chunks, per_sm of its blocks resident per
    SM: a first wave of B0 = sms x per_sm blocks whose warps take two tiles each, then a block per 8 further tiles.
    None where it does not apply: fewer tiles than two per warp of the first wave, or rows not whole ring slots."""
    b0 = sms * per_sm
    rest = tiles - 2 * b0 * WARPS
    if chunks % SEQ_U or b0 < 1 or rest < 0:
        return None
    return b0, b0 + -(-rest // WARPS)


def pdl(sm: int, part: str = "qpn") -> bool:
    """Whether the M <= 8 linear and MoE kernels (part "qpn") and fused.py's kernels (part "fused") go out as
    programmatic dependent launches (sm_90+): their grid may be scheduled before the previous kernel has
    finished -- the fused kernels and the MoE gate/up kernel let the next one go at their start, the M <= 8
    linear and MoE down kernels after their main loop (let go at a GEMV's start, a fused kernel's waiting
    blocks took SM slots from it: decode 7% slower) -- and each waits for it (griddepcontrol.wait) before reading
    what it wrote, the M = 1 NVFP4 kernels after issuing their first weight loads. $HYBRID_PDL=0 turns it
    off, =1 on (PDL_DEFAULT), =qpn on for the QPN kernels only (read at each launch: A/B runs switch it)."""
    mode = os.environ.get("HYBRID_PDL", PDL_DEFAULT)
    return sm >= 90 and mode != "0" and (mode != "qpn" or part == "qpn")


# H200, synthetic 30B-A3B decode at 16 GiB (results/runtime.md §33, §34): off 416.9, the QPN kernels ("qpn")
# 447.4, the fused kernels too ("1", with the QPN linear / down kernels' late trigger) 460.5-464.6 vs 445.1-447.8;
# two H200s 464.0 / 461.0 vs 411.5 off
PDL_DEFAULT = "1"


def use_sm90(sm: int, choice: str | None, fmt: int = 2, m: int = 0, n: int = 0, k: int = 0, sms: int = 132) -> bool:
    """Whether M > PREFILL_MIN rows on an sm_<sm> device take the wgmma GEMM (sm_90 only): forced by
    'wgmma'; by default (SM90_DEFAULT) where its modelled time is below SM90_MARGIN x the gemmf / WMMA
    pick's."""
    if sm != 90:
        return False
    if choice == "wgmma":
        return True
    return choice is None and SM90_DEFAULT[0] and m > PREFILL_MIN and _sm90_faster(fmt, m, n, k, sms)


@functools.lru_cache(maxsize=4096)
def _sm90_faster(fmt: int, m: int, n: int, k: int, sms: int) -> bool:
    from hybrid.kernels import sm90

    return sm90.plan(fmt, m, n, k, sms).us < SM90_MARGIN * prefill_us(fmt, m, n, k, sms)


def prefill_us(fmt: int, m: int, n: int, k: int, sms: int, sm: int = 90) -> float:
    """Modelled microseconds on the H200 of prefill_plan's default pick (gemmf_cost or gemm_us)."""
    plan = prefill_plan(fmt, m, n, k, sms, sm)
    tile = tuple(int(v) for v in plan.kernel.rsplit("_", 1)[1].split("x"))
    cost = gemmf_cost if "_gemmf_" in plan.kernel else gemm_us
    return cost(m, n, tile, sms, plan.grid[2], plan.ks, fmt)


def _launch_gemm(mod, plan: GemmPlan, w: QPNWeight, x: torch.Tensor, y: torch.Tensor) -> None:
    """The tiled GEMM; split-K: a transient fp32 scratch of partials [splits, M, N] + per-tile
    arrival counters (zeroed), freed after the launch (the caching allocator keeps it stream-ordered)."""
    (m, n), k = y.shape, x.shape[1]
    gx, gy, splits = plan.grid
    if gy > 65535:
        bn = int(plan.kernel.rsplit("x", 1)[1])
        raise ValueError(f"w: N={n} out features exceed the tiled GEMM's grid ({65535 * bn} at most)")
    part = cnt = y  # unused by the kernel with one split
    if splits > 1:
        buf = torch.empty(splits * m * n + gx * gy, dtype=torch.float32, device=y.device)
        part, cnt = buf, buf[splits * m * n:].view(torch.int32).zero_()
    mod.launch(plan.kernel, plan.grid, THREADS,
               [_p(w.words), _p(w.scales), ctypes.c_float(w.gscale), _p(x), _p(y), ctypes.c_int(m),
                ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(plan.ks), ctypes.c_int(1), _p(part), _p(cnt)])


def _linear_torch(x: torch.Tensor, w: QPNWeight) -> torch.Tensor:
    if w.dense is None:
        return ref_linear(x, w.qweight)
    return x @ w.dense.t() if w.device.type == "cuda" else (x.float() @ w.dense.float().t()).half()


# ---------------------------------------------------------------------------- MoE expert slots
@dataclass
class QPNExpertSlots:
    """Preallocated packed storage for S experts of one layer (gate/up [I, H], down [H, I]).

    CUDA: w13 int32 [S, 2*I/16, H/CK, 32, 4] (gate tiles then up tiles), s13 uint8 (NVFP4),
    w2 int32 [S, H/16, I/CK, 32, 4], s2 uint8, gs fp32 [S, 3] folded global scales.
    CPU: a list of (gate, up, down) QWeights per slot (reference).
    """

    num_slots: int
    hidden: int
    inter: int
    qtype: QType
    device: torch.device
    host: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.device = _device(self.device)
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS}, got {self.num_slots}")
        layout.check_shape(self.qtype, self.inter, self.hidden, "expert gate/up")
        layout.check_shape(self.qtype, self.hidden, self.inter, "expert down")
        if self.hidden % 16 or self.inter % 16:
            raise ValueError(f"expert sizes must be multiples of 16, got H={self.hidden} I={self.inter}")
        self.host = [None] * self.num_slots
        if self.device.type == "cuda":
            self._alloc()

    def _alloc(self) -> None:
        s, h, i, dev = self.num_slots, self.hidden, self.inter, self.device
        ck = layout.CHUNK[self.qtype]
        self.w13 = torch.zeros(s, 2 * i // 16, h // ck, 32, 4, dtype=torch.int32, device=dev)
        self.w2 = torch.zeros(s, h // 16, i // ck, 32, 4, dtype=torch.int32, device=dev)
        fp4 = self.qtype is QType.NVFP4
        self.s13 = torch.zeros((s, 2 * i // 16, h // ck, 8, 8) if fp4 else (16,), dtype=torch.uint8, device=dev)
        self.s2 = torch.zeros((s, h // 16, i // ck, 8, 8) if fp4 else (16,), dtype=torch.uint8, device=dev)
        self.gs = torch.zeros(s, 3, dtype=torch.float32, device=dev)

    @property
    def nbytes_per_slot(self) -> int:
        ck, h, i = layout.CHUNK[self.qtype], self.hidden, self.inter
        words = (2 * i // 16 * h // ck + h // 16 * i // ck) * 512
        scales = words // 8 if self.qtype is QType.NVFP4 else 0
        return words + scales + 12

    def _check(self, slot: int, gate: QWeight, up: QWeight, down: QWeight) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        for name, qw, shape in (("gate", gate, (self.inter, self.hidden)),
                                ("up", up, (self.inter, self.hidden)),
                                ("down", down, (self.hidden, self.inter))):
            if not isinstance(qw, QWeight) or qw.qtype is not self.qtype or tuple(qw.shape) != shape:
                got = (qw.qtype.value, tuple(qw.shape)) if isinstance(qw, QWeight) else type(qw).__name__
                raise ValueError(f"{name}: expected {self.qtype.value} {shape}, got {got}")

    def load(self, slot: int, gate: QWeight, up: QWeight, down: QWeight, stream=None) -> None:
        """Copy one expert into `slot` (packs on the device, on `stream` if given)."""
        self._check(slot, gate, up, down)
        if self.device.type != "cuda":
            self.host[slot] = (gate.to(self.device), up.to(self.device), down.to(self.device))
            return
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            qs = [q.to(self.device) for q in (gate, up, down)]
            if self.qtype is QType.NVFP4:
                (wg, sg), (wu, su), (wd, sd) = (layout.pack_nvfp4(q) for q in qs)
                self.s13[slot].copy_(torch.cat([sg, su]))
                self.s2[slot].copy_(sd)
            else:
                wg, wu, wd = (layout.pack_fp8(q) for q in qs)
            self.w13[slot].copy_(torch.cat([wg, wu]))
            self.w2[slot].copy_(wd)
            self.gs[slot].copy_(torch.tensor([layout.global_scale(q) for q in (gate, up, down)]))
        self.host[slot] = True


    def pack_host(self, gate: QWeight, up: QWeight, down: QWeight) -> dict[str, torch.Tensor]:
        """Prepack one expert on the CPU (once, at load) so that a later promotion is a pure copy:
        {'w13', 'w2', 'gs'} (+ 's13', 's2' for NVFP4), pinned when CUDA is available."""
        self._check(0, gate, up, down)
        qs = [q.to("cpu") for q in (gate, up, down)]
        if self.qtype is QType.NVFP4:
            (wg, sg), (wu, su), (wd, sd) = (layout.pack_nvfp4(q) for q in qs)
            out = dict(w13=torch.cat([wg, wu]), w2=wd, s13=torch.cat([sg, su]), s2=sd)
        else:
            wg, wu, wd = (layout.pack_fp8(q) for q in qs)
            out = dict(w13=torch.cat([wg, wu]), w2=wd)
        out["gs"] = torch.tensor([layout.global_scale(q) for q in qs], dtype=torch.float32)
        if torch.cuda.is_available():
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    def load_packed(self, slot: int, packed: dict[str, torch.Tensor], stream=None) -> None:
        """Copy an expert prepacked by pack_host into `slot` (non-blocking, on `stream` if given)."""
        if self.device.type != "cuda":
            raise ValueError("load_packed needs CUDA slots; on CPU use load()")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        names = ("w13", "w2", "gs") + (("s13", "s2") if self.qtype is QType.NVFP4 else ())
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            for name in names:
                dst = getattr(self, name)[slot]
                if tuple(packed[name].shape) != tuple(dst.shape):
                    raise ValueError(f"packed {name}: expected shape {tuple(dst.shape)}, "
                                     f"got {tuple(packed[name].shape)}")
                dst.copy_(packed[name], non_blocking=True)
        self.host[slot] = True


# ---------------------------------------------------------------------------- MoE
# qpn_moe's down launch with more than one token: at least this many chunks of K per warp (H200,
# 8 Qwen3-30B-A3B experts, forced K splits, tools/qpn_grid_probe.py --moe: T = 4 / 8 tokens NVFP4
# 24.4 / 25.8 us at 6 chunks vs 24.5 / 26.6 at 3, FP8 27.3 / 28.3 vs 28.9 / 30.9 at 3; one token:
# 3 chunks per warp stays best)
MOE_DOWN_MIN_CHUNKS = 6
# qpn_moe: outputs of at most this many fp32 values are zeroed by the route kernel (one block) instead
# of a separate memset (8 decode tokens x hidden 4096 = 32768)
ROUTE_ZERO_MAX = 32768
MOE_REDUCES = ("atomic", "ordered")
MOE_ORDERED_MIN_PAIRS = 256   # the ordered reduction's partials: room for this many pairs at first use


def moe_mt2() -> str:
    """$HYBRID_MOE_MT2, read at each launch: whether on sm_80+ steps of 9..16 tokens run the MoE layer through the
    two-8-row-tile ring kernels (qpn{2,8}_moe_{gateup,down}_mt2_as: each slot's rows in one pass, its weights
    decoded once) instead of the grouped GEMM (moe_gemm_plan; with MOE_GEMM off, the mt4 kernels): "auto" (the
    default) where the active slots average at least MOE_MT2_MIN_ROWS rows, "1" always, "0" never. HybridError
    naming the variable on anything else (checked when a CUDA session opens)."""
    return env_choice("HYBRID_MOE_MT2", ("auto", "0", "1"), "auto",
                      "auto (the two-tile ring kernels at 9..16 tokens where slots average 12 rows), 1 or 0")


# H200 (results/cuda_kernels.md, thirty-ninth session, calls 3, 4), a 30B-A3B layer's experts: the 8 experts every
# token of a 12- / 16-token step routes to (12 / 16 rows a slot) NVFP4 32.8 / 35.7 us against 45.3 / 45.6 through
# the grouped GEMM, FP8 36.1 / 37.0 vs 63.3 / 64.0; random top-k routing over 8..128 resident experts at 9 and 16
# tokens (1.1-8 rows a slot on average): slower in every case but FP8 at 12 and 16 tokens over 128 experts (NVFP4
# 16 experts top-8 at 16 tokens, 8 rows a slot: 146.4 vs 127.4)
MOE_MT2_MIN_ROWS = 12


def moe_path(t: int, a: int, s: int, fmt: int, sm: int, h: int, i: int) -> tuple[int, str, tuple | None]:
    """(MT 8-row tiles of x per pass, kernel suffix, grouped-GEMM plan or None) of qpn_moe's launch for T tokens,
    A assignments over S slots on an sm_<sm> device."""
    mode = moe_mt2() if 8 < t <= 16 and sm >= 80 else "0"
    two = mode == "1" or mode == "auto" and a / min(a, s) >= MOE_MT2_MIN_ROWS
    mt = 1 if t <= 8 else 2 if two else 4
    sfx = variant(MOE_VARIANT[0], sm) if mt == 1 else "_as" if mt == 2 else ""
    return mt, sfx, moe_gemm_plan(a, s, fmt, sm, h, i) if mt == 4 else None


def moe_reduce() -> str:
    """$HYBRID_MOE_REDUCE, read at each launch: how the M <= 8 MoE down kernel (decode, verify steps) sums the
    experts of a token. "atomic" (the default): fp32 atomic adds into y in the order the blocks happen to run (two
    launches can differ in the last bit, so a graphed decode step may differ from the eager one by a rounding).
    "ordered": each pair's output stored, then summed per column in the slots' order by the last block of its
    column group (moe_ordered_sum in cuda/qpn.cu): the same bits every launch, graphs = eager bit for bit, at 14%
    of the decode on the H200 (results/runtime.md §43), so not the default."""
    return env_choice("HYBRID_MOE_REDUCE", MOE_REDUCES, "atomic")


_MOE_WORK: dict = {}   # device -> (part, done, older buffers that captured graphs may still point at)


def _moe_workspace(dev: torch.device, pairs: int, h: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ordered down kernel's partials (>= pairs x h fp32) and column-group counters (>= groups) on dev
    (driver.grow_workspace)."""
    return grow_workspace(_MOE_WORK, dev, max(pairs, MOE_ORDERED_MIN_PAIRS) * h, groups)


# MoE prefill: a grouped GEMM per expert slot instead of the mt4 kernels (each slot's packed weights
# decoded once per BM rows instead of once per 4 tokens) for steps of more than 8 tokens (decode and
# verify steps keep the mt1 kernels), where the average rows per block row, A / min(A, S), reach the
# family's minimum. MOE_GEMM (initial value from $HYBRID_MOE_GEMM): "auto" (the
# default) the register-fragment family qpn{2,8}_moe_gemmf_{gateup_<BM>x256,down_<BM>x128} on sm_80+,
# below sm_80 the WMMA family qpn{2,8}_moe_gemm_{gateup,down}_<BM>x128 (the Volta path); "f" / "1" pick
# that family (f below sm_80: WMMA); None / "0" off (the mt4 kernels). MOE_GEMM_RULES per (family,
# format): the fewest average rows that take the GEMM, and the rows from which BM = 64 (else 32).
# Measured on the H200 (tools/gpu_moe_gemm_ab.py, one 30B-A3B layer, 128 experts resident, top-8,
# twelfth session, results/runtime.md §21.1), time against mt4: gemmf NVFP4 0.70-0.75x from 9 tokens
# (0.56 rows per slot) to 32 (2 rows), 0.68x at 16 rows, 0.65x at 32, 0.62-0.65x at 64-128 with BM 32
# (BM 64: 5% slower); gemmf FP8 0.72-0.85x from 9 tokens to 16 rows, 0.62-0.68x at 64-128 with BM 64
# (BM 32: 5-10% slower); WMMA NVFP4 1.01-1.17x up to 32 rows, 0.71-0.75x at 64-128 with BM 64 (BM 32:
# 0.96-1.0x); WMMA FP8 0.87-0.94x from 2 to 32 rows, 0.58-0.63x at 64-128 (BM 64).
MOE_GEMM: list[str | None] = [os.environ.get("HYBRID_MOE_GEMM") or "auto"]
MOE_GEMM_RULES = {("f", 2): (0, None), ("f", 8): (0, 64), ("1", 2): (64, 64), ("1", 8): (2, 64)}
MOE_GEMMF_TILES = (64, 32)  # BM of the gemmf family (gate+up BN = 256, down BN = 128)
MOE_GEMM_SPLIT = 16         # the most blocks (grid.z) that share one slot's M tiles (moe_gemm_splits)


def moe_gemm_mode() -> str | None:
    """MOE_GEMM[0] checked: None (off), "auto", "1" or "f"; HybridError naming HYBRID_MOE_GEMM on anything
    else (a CUDA session checks it when it opens, so a bad value is a one-line error before any work)."""
    choice = MOE_GEMM[0]
    if choice in (None, "0"):
        return None
    if choice not in ("auto", "1", "f"):
        from hybrid.errors import HybridError

        raise HybridError(f"HYBRID_MOE_GEMM={choice!r}: expected auto, 0 (off), 1 (WMMA) or f (sm_80+ gemmf)")
    return choice


def moe_gemm_plan(a: int, s: int, fmt: int, sm: int, h: int, i: int) -> tuple[str, int, str, int, int] | None:
    """(gate+up kernel, its grid.x, down kernel, its grid.x, BM) of the MoE grouped GEMM for A assignments
    over S slots on an sm_<sm> device, or None for the mt{1,4} kernels (MOE_GEMM off, or fewer average rows
    per block row than MOE_GEMM_RULES asks). grid.y: min(A, S) (qpn_moe_route's active slots); grid.z:
    moe_gemm_splits."""
    choice = moe_gemm_mode()
    if choice is None or a == 0:
        return None
    family = "f" if choice in ("f", "auto") and sm >= 80 else "1"
    least, bm64 = MOE_GEMM_RULES[(family, fmt)]
    avg = a / min(a, s)
    if avg < least:
        return None
    bm = 64 if bm64 is not None and avg >= bm64 else 32
    if family == "f":
        return (f"qpn{fmt}_moe_gemmf_gateup_{bm}x256", -(-i // 128), f"qpn{fmt}_moe_gemmf_down_{bm}x128",
                -(-h // 128), bm)
    return (f"qpn{fmt}_moe_gemm_gateup_{bm}x128", -(-i // 64), f"qpn{fmt}_moe_gemm_down_{bm}x128", -(-h // 128),
            bm)


def moe_gemm_splits(t: int, a: int, bm: int) -> int:
    """grid.z of the MoE grouped GEMM: the blocks that share one slot's M tiles. A slot holds at most
    min(T, A) rows (a token routes to an expert once), i.e. ceil(min(T, A) / BM) tiles; up to
    MOE_GEMM_SPLIT of them run side by side, so one expert that most of a prompt routes to does not
    serialize the layer (splits past a slot's tiles exit at once)."""
    return max(1, min(MOE_GEMM_SPLIT, -(-min(t, a) // bm)))


def qpn_moe(x: torch.Tensor, slots: QPNExpertSlots, slot_ids: torch.Tensor, token_idx: torch.Tensor,
            route_w: torch.Tensor, plan: RoutePlan | None = None) -> torch.Tensor:
    """y[T, H] fp32 = sum_a route_w[a] * down_s(silu(gate_s x[t]) * up_s x[t]), s = slot_ids[a],
    t = token_idx[a]. CUDA: route + fused gate/up + down kernels; CPU: torch reference.
    plan (hybrid.kernels.moe_route) with plan.made: the routing of slot_ids already made (by the router's
    launch), into plan.y: no route launch; the CPU reference then follows the plan's groups."""
    if not isinstance(slots, QPNExpertSlots):
        raise ValueError(f"slots: expected QPNExpertSlots, got {type(slots).__name__}")
    dev, h, i = slots.device, slots.hidden, slots.inter
    _check_tensor(x, "x", torch.float16, (None, h), dev)
    _check_tensor(slot_ids, "slot_ids", torch.int32, (None,), dev)
    a = slot_ids.shape[0]
    _check_tensor(token_idx, "token_idx", torch.int32, (a,), dev)
    _check_tensor(route_w, "route_w", torch.float32, (a,), dev)
    t = x.shape[0]
    s = slots.num_slots
    planned = plan is not None and plan.made
    if planned:
        plan.check(a, t, h, s)
        plan.made = False                                  # one use per making
    if dev.type != "cuda":
        if planned:
            return ref_moe_planned(x, slots.host, plan, token_idx, route_w)
        return ref_moe(x, slots.host, slot_ids, token_idx, route_w)
    if a == 0 or t == 0:
        return torch.zeros(t, h, dtype=torch.float32, device=dev)
    mod = _module(dev)
    rows = min(a, s)  # block rows of the expert kernels: at most one per active slot
    hbuf = torch.empty(a, i, dtype=torch.float16, device=dev)
    if planned:
        y, offsets, perm, slot_list = plan.y, plan.offsets, plan.perm, plan.active
    else:
        # the route kernel zeroes a small output (decode) itself: one graph node fewer per layer
        y = torch.empty(t, h, dtype=torch.float32, device=dev)
        nzero = t * h if t * h <= ROUTE_ZERO_MAX else 0
        if not nzero:
            y.zero_()
        offsets = torch.empty(s + 1, dtype=torch.int32, device=dev)
        perm = torch.empty(a, dtype=torch.int32, device=dev)
        slot_list = torch.empty(rows, dtype=torch.int32, device=dev)
        mod.launch("qpn_moe_route", (1, 1, 1), 1024,
                   [_p(slot_ids), ctypes.c_int(a), ctypes.c_int(s), _p(offsets), _p(perm), _p(slot_list), _p(y),
                    ctypes.c_int(nzero)])
    fmt, ck, sms = _fmt(slots.qtype), layout.CHUNK[slots.qtype], _sms(dev)
    mt, sfx, plan = moe_path(t, a, s, fmt, mod.sm, h, i)
    active = min(a, s)
    ws13, ws2 = slots.w13[0].numel() // 4, slots.w2[0].numel() // 4
    ss13 = slots.s13[0].numel() // 8 if slots.s13.dim() > 1 else 0
    ss2 = slots.s2[0].numel() // 8 if slots.s2.dim() > 1 else 0
    if plan is not None:
        z = moe_gemm_splits(t, a, plan[4])
        mod.launch(plan[0], (plan[1], rows, z), THREADS,
                   [_p(slots.w13), _p(slots.s13), _p(slots.gs), ctypes.c_longlong(ws13),
                    ctypes.c_longlong(ss13), _p(x), _p(token_idx), _p(offsets), _p(perm), _p(slot_list),
                    _p(hbuf), ctypes.c_int(h), ctypes.c_int(i)])
        mod.launch(plan[2], (plan[3], rows, z), THREADS,
                   [_p(slots.w2), _p(slots.s2), _p(slots.gs), ctypes.c_longlong(ws2),
                    ctypes.c_longlong(ss2), _p(hbuf), _p(token_idx), _p(route_w), _p(offsets),
                    _p(perm), _p(slot_list), _p(y), ctypes.c_int(h), ctypes.c_int(i)])
        return y
    ks = _pick_ks(i // 16 * active, h // ck, sms)
    mod.launch(f"qpn{fmt}_moe_gateup_mt{mt}{sfx}", (-(-(i // 16) // (WARPS // ks)), rows, 1), THREADS,
               [_p(slots.w13), _p(slots.s13), _p(slots.gs), ctypes.c_longlong(ws13),
                ctypes.c_longlong(ss13), _p(x), _p(token_idx), _p(offsets), _p(perm), _p(slot_list), _p(hbuf),
                ctypes.c_int(h), ctypes.c_int(i), ctypes.c_int(ks)], pdl=pdl(mod.sm))
    ks = _pick_ks(h // 16 * active, i // ck, sms)
    while t > 1 and ks > 1 and (i // ck) / ks < MOE_DOWN_MIN_CHUNKS:   # several tokens: longer warp items
        ks //= 2
    groups = -(-(h // 16) // (WARPS // ks))
    part = done = None
    if mt == 1 and moe_reduce() == "ordered":
        part, done = _moe_workspace(dev, a, h, groups)
    mod.launch(f"qpn{fmt}_moe_down_mt{mt}{sfx}{'' if part is None else '_ord'}", (groups, rows, 1), THREADS,
               [_p(slots.w2), _p(slots.s2), _p(slots.gs), ctypes.c_longlong(ws2),
                ctypes.c_longlong(ss2), _p(hbuf), _p(token_idx), _p(route_w), _p(offsets),
                _p(perm), _p(slot_list), _p(y), _p(part), _p(done), ctypes.c_int(h), ctypes.c_int(i),
                ctypes.c_int(ks)],
               pdl=pdl(mod.sm))
    return y


def stage_pack_store(src: torch.Tensor, slots: QPNExpertSlots, first: int, n: int) -> None:
    """n experts' slots as the CPU expert store holds them (cpu/layout.py NVFP4 int16 tiles; src u8
    [>= n, S] on the card) -> the QPN2 words and scales of `slots` first..first+n-1, one launch of
    qpn2_stage_pack on the current stream (the caller writes the folded global scales)."""
    h, i = slots.hidden, slots.inter
    if slots.qtype is not QType.NVFP4 or slots.device.type != "cuda":
        raise ValueError(f"stage pack: NVFP4 slots on a CUDA card, got {slots.qtype.value} on {slots.device}")
    if not (src.is_cuda and src.device == slots.device and src.dtype == torch.uint8 and src.dim() == 2
            and src.is_contiguous() and src.shape[0] >= n):
        raise ValueError(f"stage pack: store slots must be contiguous u8 [>= {n}, S] on {slots.device}, "
                         f"got {src.dtype} {tuple(src.shape)} on {src.device}")
    if not (0 <= first and first + n <= slots.num_slots):
        raise ValueError(f"stage pack: slots {first}..{first + n - 1} outside 0..{slots.num_slots - 1}")
    if n == 0:
        return
    words = (2 * i // 16) * (h // 64) * 128 + (h // 16) * (i // 64) * 128
    _module(src.device).launch("qpn2_stage_pack", (-(-words // THREADS), n, 1), THREADS,
                               [_p(src), ctypes.c_longlong(src.shape[1]), ctypes.c_int(h), ctypes.c_int(i),
                                _p(slots.w13[first]), _p(slots.s13[first]), _p(slots.w2[first]),
                                _p(slots.s2[first])])


# ---------------------------------------------------------------------------- plain read (benchmark)
READ_BLOCKS_PER_SM = 8   # 8 x 256 threads: a full SM, 4 x 16 B loads in flight per thread (128 KB per SM)


def read_bytes(buf: torch.Tensor) -> None:
    """Read a CUDA tensor's bytes once with qpn_read (nothing written): the time a kernel that only
    streams them takes (hybrid-bench cuda-kernels' plain-read reference)."""
    if buf.device.type != "cuda" or not buf.is_contiguous():
        raise ValueError("buf: expected a contiguous CUDA tensor")
    n = buf.numel() * buf.element_size()
    if n % 16 or buf.data_ptr() % 16:
        raise ValueError(f"buf: expected a 16-byte aligned size and address, got {n} bytes")
    mod = _module(buf.device)
    sink = _read_sink(buf.device)
    mod.launch("qpn_read", (_sms(buf.device) * READ_BLOCKS_PER_SM, 1, 1), THREADS,
               [_p(buf), ctypes.c_longlong(n // 16), _p(sink)])


@functools.lru_cache(maxsize=None)
def _read_sink(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)

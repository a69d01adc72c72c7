"""The fused experts of cpu/expert.py on Numba's pool as one parallel region with no phase barrier.

    experts_dataflow(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, n)

Same inputs, same result (bit for bit) as cpu/expert.py's `experts_forward`.  `n` parts claim
units one at a time from one shared counter, in this order:
    Q   x's rows quantized to int16 in chunks of QROWS (NVFP4_I16 only, T >= QUANT_PARALLEL_ROWS;
        fewer rows are quantized by the caller before the region)
    G   (expert e, I-tile t), e-major: h[rows of e, tile t] = silu(gate) * up    (waits for all Q)
    D   (expert e, H-tile t), e-major: part[rows of e, tile t] = down(h[rows of e])
        (waits until the G units of expert e are done: experts finish in claim order, so only
        the last experts' D units can find their G units still running)
and the part that completes the last D unit of H-tile t adds the E partials of that tile into
out, expert by expert in list order: out[rows[p], cols] += w[p] * scale_e * part[p, cols], the
operations of `experts_down` in the same order.
    experts_dataflow_on(..., n, pf, pfmode, dataflow_prepare(qkind, x, rows, ptr, H, I, R))
runs the same on scratch prepared by the caller, so that another thread can join the call with
dataflow_part(..., pf, pfmode, the same scratch) (the runner's sync() helping its pool).
Why: two phases with a barrier between them (expert.py's `experts_parallel`) leave every part
idle while the slowest finishes its last phase-1 unit, and phase 2's H-tiles (32 for Qwen3, each
all E experts' rows) are too few and too long to share evenly among 16 threads; here phase 2 is
E times finer and nothing waits for a phase to end.
Waits spin on the counters with `pause`, yielding the CPU after SPIN_YIELD rounds (a part whose
unit is not ready must not take the core from the part computing it, where cores are shared).

Legend: T tokens, H hidden, I intermediate, E listed experts, P = Σ_e rows of expert e,
NTI / NTH I- / H-tiles (R rows each), Hpad = NTH * R.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu.atomic import fetch_add
from cpu.expert import FP8, NVFP4_I16, QUANT_PARALLEL_ROWS, _tile, experts_gate_up, gate_up_unit_i16, tile_nbytes
from cpu.gemm import FP8_FACTOR, MB, NVFP4_FACTOR, scratch
from cpu.i16 import I16_FACTOR, NO_LIMIT, nvfp4_i16_tile_pf, quantize_rows
from cpu.layout import GROUP
from cpu.tiles import JIT

QROWS = 16                # x rows per Q unit
PF_ON, PF_STOP, PF_NEXT = 0, 1, 2   # prefetch near a unit's end (experts_dataflow)
SPIN_YIELD = 2000         # pause rounds before a waiting part yields its CPU
LINE = 8                  # int64 counters per 64-byte cache line
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")



@intrinsic
def cpu_pause(typingctx):
    """x86 `pause` (a spin-wait hint); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:                        # an intrinsic: Numba's JIT has no inline-asm parser
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """libc sched_yield() (declared by name, so the calling functions stay cacheable, which a
    ctypes pointer would prevent)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(nogil=True, cache=True)
def pause_loop(n):
    """n x86 `pause`s (timing the spin unit; hybrid/experts/cpu_runner.py pause_ns)."""
    for _ in range(n):
        cpu_pause()


@njit(nogil=True, cache=True)
def spin_while_equal(state, want, pauses):
    """Spin (pause) while state[0] == want, at most `pauses` rounds -> True if it changed."""
    for _ in range(pauses):
        if fetch_add(state, 0, 0) != want:
            return True
        cpu_pause()
    return fetch_add(state, 0, 0) != want


@njit(nogil=True, cache=True)
def wait_count(state, i, want):
    """Spin until state[i] >= want (atomic read-modify-write of + 0: sees other parts' writes)."""
    k = 0
    while fetch_add(state, i, 0) < want:
        cpu_pause()
        k += 1
        if k >= SPIN_YIELD:
            sched_yield()
            k = 0


@njit(**JIT)
def down_part(qkind, arena, dn_off, hq, hs, h, ptr, e, t, part, I, R, pf, pf_lim, pf_jump):
    """D unit (e, t): part[ptr[e]:ptr[e+1], t*R:(t+1)*R] = unscaled down-projection of h's rows
    (NVFP4_I16 prefetch: nvfp4_i16_tile_pf)."""
    hrows = np.arange(part.shape[0])
    if qkind == NVFP4_I16:
        tb = tile_nbytes(NVFP4_I16, I, R)
        base = dn_off[e] + t * tb
        for b0 in range(ptr[e], ptr[e + 1], MB):
            b1 = min(ptr[e + 1], b0 + MB)
            nvfp4_i16_tile_pf(arena[base: base + tb], I // GROUP, hq, hs, hrows, b0, b1,
                              part[b0:b1, t * R:(t + 1) * R], pf, pf_lim, pf_jump)
        return
    tb = tile_nbytes(qkind, I, R)
    acc, dec = scratch(R)
    for b0 in range(ptr[e], ptr[e + 1], MB):
        b1 = min(ptr[e + 1], b0 + MB)
        _tile(qkind, arena, dn_off[e] + t * tb, I, h, hrows, b0, b1, acc, dec)
        part[b0:b1, t * R:(t + 1) * R] = acc[:b1 - b0]


@njit(**JIT)
def reduce_tile(qkind, scl, part, rows, ptr, w, t, out, H, R):
    """out[rows[p], tile t] += w[p] * scale_e * part[p, tile t], experts in list order."""
    fac = I16_FACTOR if qkind == NVFP4_I16 else (FP8_FACTOR if qkind == FP8 else NVFP4_FACTOR)
    n0 = t * R
    nr = min(R, H - n0)
    for e in range(len(ptr) - 1):
        cd = scl[e, 2] * fac
        for p in range(ptr[e], ptr[e + 1]):
            tok, wm = rows[p], w[p] * cd
            for r in range(nr):
                out[tok, n0 + r] += wm * part[p, n0 + r]


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def experts_dataflow(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, n, pf, pfmode):
    """Both phases of experts_forward as Q, G, D units claimed by n parts (module doc).
    NVFP4_I16 prefetch, pf bytes ahead; near a unit's end (G: its gate|up tile pair, D: its down
    tile) it goes, pfmode PF_ON: on into the bytes that follow (often another part's unit),
    PF_STOP: nowhere, PF_NEXT: into the part's next unit, claimed one unit ahead."""
    scr = dataflow_prepare(qkind, x, rows, ptr, H, I, R)
    for k in prange(n):
        dataflow_part(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, pf, pfmode, scr)


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def experts_dataflow_on(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, n, pf, pfmode, scr):
    """experts_dataflow on scratch prepared by the caller (dataflow_prepare), so that other threads
    may run parts of the same call beside the pool's n (dataflow_part on the same scratch)."""
    for k in prange(n):
        dataflow_part(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, pf, pfmode, scr)


@njit(nogil=True, fastmath=True, cache=True)
def _sizes(qkind, T, H, E, P, I, R):
    """(byte offsets, byte sizes) of the parts of one call's scratch: state i64 [LINE + E + nth + 1] (+ nq in its last word),
    part f32 [P, Hpad], h f32 [P, hcols], xq i16 [T, H], xs f32 [T, H/16], hq i16 [P, Ipad],
    hs f32 [P, Ipad/16] (int16 parts empty unless NVFP4_I16), each 64-byte aligned."""
    nti = (I + R - 1) // R
    nth = (H + R - 1) // R
    i16 = qkind == NVFP4_I16
    Pq = P if i16 else 0
    Tq = T if i16 else 0
    n = np.array([8 * (LINE + E + nth + 2), 4 * P * nth * R, 4 * P * (0 if i16 else nti * R), 2 * Tq * H,
                  4 * Tq * (H // GROUP), 2 * Pq * nti * R, 4 * Pq * (nti * R // GROUP)], np.int64)
    off = np.zeros(8, np.int64)
    for i in range(7):
        off[i + 1] = off[i] + (n[i] + 63) // 64 * 64
    return off, n


@njit(nogil=True, fastmath=True, cache=True)
def dataflow_prepare(qkind, x, rows, ptr, H, I, R):
    """-> scr u8: one call's counters (zeroed) and scratch in one array (_sizes), x already
    quantized where the call has no Q units (T < QUANT_PARALLEL_ROWS)."""
    T = x.shape[0]
    E = len(ptr) - 1
    off = _sizes(qkind, T, H, E, rows.shape[0], I, R)[0]
    scr = np.empty(off[7], np.uint8)
    scr[:off[1]] = 0
    nq = (T + QROWS - 1) // QROWS if qkind == NVFP4_I16 and T >= QUANT_PARALLEL_ROWS else 0
    scr[:off[1]].view(np.int64)[LINE + E + (H + R - 1) // R + 1] = nq
    if qkind == NVFP4_I16 and nq == 0:
        b = _views(qkind, scr, T, H, E, rows.shape[0], I, R)
        quantize_rows(x, 0, T, b[3], b[4])
    return scr


@njit(nogil=True, fastmath=True, cache=True)
def _views(qkind, scr, T, H, E, P, I, R):
    """(state, part, h, xq, xs, hq, hs) views of scr (_sizes)."""
    off, n = _sizes(qkind, T, H, E, P, I, R)
    nti = (I + R - 1) // R
    nth = (H + R - 1) // R
    i16 = qkind == NVFP4_I16
    Pq = P if i16 else 0
    Tq = T if i16 else 0
    hc = 0 if i16 else nti * R
    state = scr[off[0]: off[0] + n[0]].view(np.int64)
    part = scr[off[1]: off[1] + n[1]].view(np.float32).reshape((P, nth * R))
    h = scr[off[2]: off[2] + n[2]].view(np.float32).reshape((P, hc))
    xq = scr[off[3]: off[3] + n[3]].view(np.int16).reshape((Tq, H))
    xs = scr[off[4]: off[4] + n[4]].view(np.float32).reshape((Tq, H // GROUP))
    hq = scr[off[5]: off[5] + n[5]].view(np.int16).reshape((Pq, nti * R))
    hs = scr[off[6]: off[6] + n[6]].view(np.float32).reshape((Pq, nti * R // GROUP))
    return state, part, h, xq, xs, hq, hs


@njit(nogil=True, fastmath=True, cache=True)
def dataflow_part(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, pf, pfmode, scr):
    """One part: claims and runs units of the call until none is left (any number of parts, on
    any threads, may run at once on the same prepared scratch; returns when every unit is claimed,
    its own claimed units done; the call is complete when every part has returned)."""
    E = len(ptr) - 1
    state, part, h, xq, xs, hq, hs = _views(qkind, scr, x.shape[0], H, E, rows.shape[0], I, R)
    nq = state[state.shape[0] - 1]
    nti = (I + R - 1) // R
    nth = (H + R - 1) // R
    i16 = qkind == NVFP4_I16
    T = x.shape[0]
    n1 = E * nti
    n2 = E * nth
    tb1, tb2 = tile_nbytes(qkind, H, R), tile_nbytes(qkind, I, R)
    qdone = LINE + E + nth
    total = nq + n1 + n2
    u = fetch_add(state, 0, 1)
    while u < total:
        v = fetch_add(state, 0, 1) if pfmode == PF_NEXT else total     # claimed one ahead
        if u < nq:
            quantize_rows(x, u * QROWS, min(T, (u + 1) * QROWS), xq, xs)
            fetch_add(state, qdone, 1)
        elif u < nq + n1:
            g = u - nq
            wait_count(state, qdone, nq)
            if i16:
                end = _unit_start(gu_off, g, nti, tb1) + 2 * tb1
                lim, jump = _pf_bounds(pf, pfmode, 2 * tb1, end, v, gu_off, dn_off, nti, tb1, nq, n1, nth, tb2,
                                       total)
                gate_up_unit_i16(arena, gu_off, scl, xq, xs, rows, ptr, g, hq, hs, H, I, R, pf, lim, jump)
            else:
                experts_gate_up(qkind, arena, gu_off, scl, x, rows, ptr, g, g + 1, h, H, I, R)
            fetch_add(state, LINE + g // nti, 1)
        else:
            d = u - nq - n1
            e, t = d // nth, d % nth
            wait_count(state, LINE + e, nti)
            end = dn_off[e] + (t + 1) * tb2
            lim, jump = _pf_bounds(pf, pfmode, tb2, end, v, gu_off, dn_off, nti, tb1, nq, n1, nth, tb2, total)
            down_part(qkind, arena, dn_off, hq, hs, h, ptr, e, t, part, I, R, pf, lim, jump)
            if fetch_add(state, LINE + E + t, 1) == E - 1:
                reduce_tile(qkind, scl, part, rows, ptr, w, t, out, H, R)
        u = v if pfmode == PF_NEXT else fetch_add(state, 0, 1)


@njit(nogil=True, cache=True)
def _unit_start(gu_off, u, nti, tb1):
    """Arena offset of the first weight byte of G unit u (0-based among G units)."""
    return gu_off[u // nti] + 2 * (u % nti) * tb1


@njit(nogil=True, cache=True)
def _pf_bounds(pf, pfmode, lim, end, v, gu_off, dn_off, nti, tb1, nq, n1, nth, tb2, total):
    """(pf_lim, pf_jump) of nvfp4_i16_tile_pf for a unit whose bytes end at arena offset `end`
    (lim bytes from its start), the part's next unit being v (PF_NEXT)."""
    if pfmode == PF_ON:
        return NO_LIMIT, 0
    if pfmode == PF_STOP or v >= total or v < nq:
        return lim, -pf
    if v < nq + n1:
        nxt = _unit_start(gu_off, v - nq, nti, tb1)
    else:
        d = v - nq - n1
        nxt = dn_off[d // nth] + (d % nth) * tb2
    return lim, nxt - end

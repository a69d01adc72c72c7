"""NVFP4 weights x int16 activations: explicit AVX2 vector IR (vpshufb decode, vpmaddwd products).

One call of `block_m{MT}` computes 8 output rows (one int32/fp32 lane each) x MT tokens over all
G groups of one 8-row block (layout: cpu/layout.py, NVFP4 int16 tile).  Per group and 32 code bytes
(8 rows x 8 elements):
    L = vpshufb(T, V & 0x0F)            H = vpshufb(T, (V >> 4) & 0x0F)      T[code] = 2 * E2M1
    P1 = L << 8   P2 = L & 0xFF00   P3 = H << 8   P4 = H & 0xFF00   (16-bit lanes: 512 * E2M1, exact)
    isum[m] += vpmaddwd(Pq, broadcast(xq pair q of token m))                   (8 int32 lanes = rows)
               (one vpdpwssd per product where the target has VNNI and MT >= 2, cpu/isa.py)
plus one software prefetch PREFETCH bytes ahead (one core's DRAM stream needs it),
then per group and token one int32 -> fp32 convert and one FMA with (row's e4m3 scale x token's block
scale).  |512 * 6 * 32767 * 16| < 2^31: a group's integer dot cannot overflow.  The activation
row is stored permuted within each 8 elements (PERM) so that pair q of P1..P4 is one i32 load.

Without AVX2 (isa.HAS_AVX2 False) the same kernels are emitted as generic IR (slow, correct), so
this module compiles everywhere; the kernel family used by default is chosen in cpu/isa.py.

Scale folded by the caller: y = acc * weight_scale_2 * I16_FACTOR
    (acc = Σ_g isum_g * e4m3_g * 2^-8 * xs_g, isum = Σ 512 E2M1 * xq, x ~ xq * xs).
Legend: MT tokens per call (1..8), G groups of 16 along K, R rows per tile, MB rows per block.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu.isa import HAS_AVX2, HAS_VNNI

E2M1X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)   # 2 * E2M1[code] (int8)
PERM = np.array([0, 4, 2, 6, 1, 5, 3, 7], np.int64)   # xq[8h + p] = x[8h + PERM[p]]
QMAX = 32767.0

I16_FACTOR = np.float32(2.0 ** 8 / 512)               # e4m3 decode 2^-8, weights 512 * E2M1
PREFETCH = 8192   # bytes ahead of each group's codes (128 groups); paired A/B at M = 1, 1 thread, 64 MB of
                  # experts: 1 KB 1.10-1.21x over none, 8 KB 1.46x over 1 KB, 16 KB ~ 8 KB, 32 KB 0.96x
NO_LIMIT = 1 << 62                                    # pf_lim that never binds
GROUP_BYTES = 72                                      # 64 code bytes (8 rows x 16) + 8 scale bytes
JIT = dict(nogil=True, fastmath=True, cache=True)

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_V32I8, _V16I16, _V8I32 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
_V8I8, _V8I16, _V8F32 = ir.VectorType(_I8, 8), ir.VectorType(_I16, 8), ir.VectorType(_F32, 8)
_V8F16 = ir.VectorType(ir.HalfType(), 8)


def _splat(ty, v):
    return ir.Constant(ty, [v] * ty.count)


def _declare(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def _pshufb(builder, table, idx):
    """vpshufb with idx in 0..15 (no zeroing bit)."""
    if HAS_AVX2:
        return builder.call(_declare(builder.module, "llvm.x86.avx2.pshuf.b", _V32I8, [_V32I8, _V32I8]),
                            [table, idx])
    out = ir.Constant(_V32I8, None)
    for i in range(32):                                           # generic: 16 entries per 128-bit lane
        j = builder.add(builder.zext(builder.extract_element(idx, ir.Constant(_I32, i)), _I32),
                        ir.Constant(_I32, 16 * (i // 16)))
        out = builder.insert_element(out, builder.extract_element(table, j), ir.Constant(_I32, i))
    return out


def _pmaddwd(builder, a, b):
    if HAS_AVX2:
        return builder.call(_declare(builder.module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16]),
                            [a, b])
    v16 = ir.VectorType(_I32, 16)
    p = builder.mul(builder.sext(a, v16), builder.sext(b, v16))
    even = ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2)))
    odd = ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2)))
    return builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))


def _dpwssd(builder, acc, a, b):
    """acc + vpmaddwd(a, b) as one vpdpwssd (AVX-VNNI / AVX512-VNNI; the same int32 sums)."""
    fn = _declare(builder.module, "llvm.x86.avx512.vpdpwssd.256", _V8I32, [_V8I32, _V8I32, _V8I32])
    return builder.call(fn, [acc, builder.bitcast(a, _V8I32), builder.bitcast(b, _V8I32)])


def _broadcast(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, None), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _at(builder, base, nbytes, ty):
    """Typed pointer to base (i8*) + nbytes."""
    return builder.bitcast(builder.gep(base, [nbytes]), ty.as_pointer())


def _decode_scales(builder, p):
    """8 e4m3 bytes -> <8 x f32> = value * 2^-8 (sign-extend, << 7, & 0xBF80, fp16 -> fp32)."""
    w = builder.sext(builder.load(_at(builder, p, ir.Constant(_I64, 0), _V8I8), align=1), _V8I16)
    w = builder.and_(builder.shl(w, _splat(_V8I16, 7)), _splat(_V8I16, 0xBF80))
    return builder.fpext(builder.bitcast(w, _V8F16), _V8F32)


def _weights(builder, v):
    """32 code bytes (8 rows x 8 elements) -> the four vpmaddwd operands P1..P4 (see module doc)."""
    table = ir.Constant(_V32I8, [x & 0xFF for x in E2M1X2] * 2)
    lo = _pshufb(builder, table, builder.and_(v, _splat(_V32I8, 0x0F)))
    sh = builder.bitcast(builder.lshr(builder.bitcast(v, _V16I16), _splat(_V16I16, 4)), _V32I8)
    hi = _pshufb(builder, table, builder.and_(sh, _splat(_V32I8, 0x0F)))
    out = []
    for b in (lo, hi):
        w = builder.bitcast(b, _V16I16)
        out += [builder.shl(w, _splat(_V16I16, 8)), builder.and_(w, _splat(_V16I16, 0xFF00 - 0x10000))]
    return out


def _make_block(MT: int):
    vnni = HAS_VNNI and MT >= 2        # M = 1: LLVM already fuses most pairs where it pays (its choice)

    @intrinsic
    def block(typingctx, tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump):
        """acc[a0 + m, col:col + 8] = Σ_g isum * scale (m < MT, token row rows[p0 + m]); see module doc.
        Prefetches tile + a per group, a = off + 64 g + pf, plus pf_jump where a >= pf_lim
        (bytes from the tile's start): see nvfp4_i16_tile_pf."""
        sig = types.void(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)

        def codegen(context, builder, signature, args):
            g_v, p0_v, a0_v, col_v = args[2], args[6], args[8], args[9]
            off_v, pf_v, lim_v, jump_v = (context.cast(builder, args[i], signature.args[i], types.int64)
                                          for i in (1, 10, 11, 12))
            hint_v = builder.and_(pf_v, ir.Constant(_I64, 3))         # pf's low 2 bits: T0, T1, T2, NTA
            dist_v = builder.sub(pf_v, hint_v)
            arr = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else None
                   for t, v in zip(signature.args, args)]
            tile0 = builder.bitcast(arr[0].data, _I8.as_pointer())
            base = builder.gep(tile0, [off_v])
            sbase = builder.gep(base, [builder.mul(g_v, ir.Constant(_I64, 64))])
            xq_a, xs_a, rows_a, acc_a = arr[3], arr[4], arr[5], arr[7]
            xq_s0 = cgutils.unpack_tuple(builder, xq_a.strides)[0]
            xs_s0 = cgutils.unpack_tuple(builder, xs_a.strides)[0]
            acc_s0 = cgutils.unpack_tuple(builder, acc_a.strides)[0]
            xq0 = builder.bitcast(xq_a.data, _I8.as_pointer())
            xs0 = builder.bitcast(xs_a.data, _I8.as_pointer())
            xq_rows, xs_rows, accs = [], [], []
            for m in range(MT):
                r = builder.load(builder.gep(rows_a.data, [builder.add(p0_v, ir.Constant(_I64, m))]))
                xq_rows.append(builder.gep(xq0, [builder.mul(r, xq_s0)]))
                xs_rows.append(builder.gep(xs0, [builder.mul(r, xs_s0)]))
                a = cgutils.alloca_once(builder, _V8F32)
                builder.store(_splat(_V8F32, 0.0), a)
                accs.append(a)
            with cgutils.for_range(builder, g_v) as loop:
                g = loop.index
                sc = _decode_scales(builder, builder.gep(sbase, [builder.mul(g, ir.Constant(_I64, 8))]))
                cb = builder.gep(base, [builder.mul(g, ir.Constant(_I64, 64))])
                pf = _declare(builder.module, "llvm.prefetch.p0i8", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
                at = builder.add(builder.add(off_v, builder.mul(g, ir.Constant(_I64, 64))), dist_v)
                at = builder.select(builder.icmp_signed("<", at, lim_v), at, builder.add(at, jump_v))
                addr = builder.gep(tile0, [at])
                sw = builder.switch(hint_v, builder.function.append_basic_block("pf_t0"))
                done = builder.function.append_basic_block("pf_done")
                for h, blk in enumerate([sw.default] + [builder.function.append_basic_block(f"pf_h{h}") for h in (1, 2, 3)]):
                    if h:
                        sw.add_case(ir.Constant(_I64, h), blk)
                    builder.position_at_end(blk)
                    builder.call(pf, [addr, ir.Constant(_I32, 0), ir.Constant(_I32, 3 - h), ir.Constant(_I32, 1)])
                    builder.branch(done)
                builder.position_at_end(done)
                ops = []
                for h in range(2):
                    v = builder.load(_at(builder, cb, ir.Constant(_I64, 32 * h), _V32I8), align=1)
                    ops += _weights(builder, v)
                xoff = builder.mul(g, ir.Constant(_I64, 32))              # 16 int16 per group
                fmuladd = _declare(builder.module, "llvm.fmuladd.v8f32", _V8F32, [_V8F32] * 3)
                for m in range(MT):
                    isum = None
                    for q in range(8):
                        at = builder.add(xoff, ir.Constant(_I64, 4 * q))
                        pair = builder.load(_at(builder, xq_rows[m], at, _I32), align=2)
                        xv = builder.bitcast(_broadcast(builder, pair, _V8I32), _V16I16)
                        if vnni and isum is not None:
                            isum = _dpwssd(builder, isum, ops[q], xv)
                            continue
                        prod = _pmaddwd(builder, ops[q], xv)
                        isum = prod if isum is None else builder.add(isum, prod)
                    f = builder.sitofp(isum, _V8F32)
                    s = builder.load(_at(builder, xs_rows[m], builder.mul(g, ir.Constant(_I64, 4)), _F32))
                    scale = builder.fmul(sc, _broadcast(builder, s, _V8F32))
                    builder.store(builder.call(fmuladd, [f, scale, builder.load(accs[m])]), accs[m])
            accb = builder.bitcast(acc_a.data, _I8.as_pointer())
            for m in range(MT):
                row = builder.add(a0_v, ir.Constant(_I64, m))
                at = builder.add(builder.mul(row, acc_s0), builder.mul(col_v, ir.Constant(_I64, 4)))
                builder.store(builder.load(accs[m]), _at(builder, accb, at, _V8F32), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return block


block_m1, block_m2, block_m3, block_m4 = (_make_block(m) for m in (1, 2, 3, 4))
block_m5, block_m6, block_m7, block_m8 = (_make_block(m) for m in (5, 6, 7, 8))


@njit(**JIT)
def _block(tile, off, G, xq, xs, rows, p0, k, acc, a0, col, pf, pf_lim, pf_jump):
    """k (1..8) tokens rows[p0:p0 + k] -> acc[a0:a0 + k, col:col + 8]."""
    if k >= 8:
        block_m8(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 7:
        block_m7(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 6:
        block_m6(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 5:
        block_m5(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 4:
        block_m4(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 3:
        block_m3(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    elif k == 2:
        block_m2(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)
    else:
        block_m1(tile, off, G, xq, xs, rows, p0, acc, a0, col, pf, pf_lim, pf_jump)


@njit(**JIT)
def nvfp4_i16_tile(tile, G, xq, xs, rows, p0, p1, acc):
    """tile u8 [R/8 * G * 72] (cpu/layout.py); tokens rows[p0:p1] of xq i16 [*, >=16G] / xs f32
    [*, >=G] -> acc f32 [>= p1 - p0, R] (unscaled, see module doc).  Block-major: each 8-row
    block's bytes stream once, for every 8 tokens (decode repeats per 8 tokens, from L1).
    Prefetches PREFETCH bytes ahead, past the tile's end too (nvfp4_i16_tile_pf redirects it)."""
    nvfp4_i16_tile_pf(tile, G, xq, xs, rows, p0, p1, acc, PREFETCH, NO_LIMIT, 0)


@njit(**JIT)
def nvfp4_i16_tile_pf(tile, G, xq, xs, rows, p0, p1, acc, pf, pf_lim, pf_jump):
    """nvfp4_i16_tile, prefetching pf & ~3 bytes ahead of each group's codes with the locality
    hint pf & 3 (0 prefetcht0, 1 prefetcht1, 2 prefetcht2, 3 prefetchnta); a target at or past
    pf_lim bytes from the tile's start moves by pf_jump bytes: to where the caller reads next
    (another unit), or by -pf onto the current group (no prefetch past pf_lim).  Any address
    is allowed: a prefetch never faults."""
    nb = tile.shape[0] // (GROUP_BYTES * G)
    for b in range(nb):
        for i in range(0, p1 - p0, 8):
            _block(tile, b * GROUP_BYTES * G, G, xq, xs, rows, p0 + i, min(8, p1 - p0 - i), acc, i, 8 * b,
                   pf, pf_lim, pf_jump)


# ----------------------------------------------------------------------------- activations
@njit(**JIT)
def quantize_row(x, xq, xs):
    """x f32 [K] -> xq i16 [K] (PERM order within each 8), xs f32 [K/16]: per 16-block,
    xq = rint(x * 32767 / amax), xs = amax / 32767 (0 for an all-zero block)."""
    for g in range(x.shape[0] // 16):
        c = 16 * g
        amax = np.float32(0.0)
        for j in range(16):
            amax = max(amax, abs(x[c + j]))
        inv = np.float32(QMAX) / amax if amax > 0 else np.float32(0.0)
        xs[g] = amax / np.float32(QMAX)
        for h in range(2):
            for p in range(8):
                xq[c + 8 * h + p] = np.int16(np.rint(x[c + 8 * h + PERM[p]] * inv))


@njit(**JIT)
def quantize_rows(x, r0, r1, xq, xs):
    """Rows [r0, r1) of x f32 [T, K] -> xq i16 [T, K], xs f32 [T, K/16] (quantize_row)."""
    for r in range(r0, r1):
        quantize_row(x[r], xq[r], xs[r])

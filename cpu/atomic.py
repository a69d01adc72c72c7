"""Atomic fetch-and-add on an int64 array element, for Numba code (a work counter shared by threads).

    u = fetch_add(counter, i, k)    # counter[i] += k atomically (seq_cst); returns the old value

Used by cpu/expert.py's `experts_parallel`: each thread claims the next unit of a phase from one
counter instead of owning a fixed range, so a slow or descheduled thread holds back at most the
unit it is on.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1
            and isinstance(idx, types.Integer) and isinstance(val, types.Integer)):
        return None
    sig = types.int64(arr, idx, val)

    def codegen(context, builder, signature, args):
        a, i, v = args
        aty, ity, vty = signature.args
        ary = context.make_array(aty)(context, builder, a)
        i = context.cast(builder, i, ity, types.intp)
        v = context.cast(builder, v, vty, types.int64)
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [i])
        return builder.atomic_rmw("add", ptr, v, "seq_cst")
    return sig, codegen


@njit(nogil=True, cache=True)
def counters(k):
    """k zeroed int64 counters.  A call, not np.zeros inline: inside a parallel=True function Numba
    turns np.zeros into a parfor of its own, which it may fuse with, or move relative to, the loops
    that use the counters (a counter allocated inline read back 0 after its prange loop)."""
    return np.zeros(k, np.int64)

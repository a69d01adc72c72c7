"""The decode MoE down kernel's body (down_body in cuda/qpn.cu, the register pipeline: qpn{2,8}_moe_down_mt1 and its
ordered form _ord) run on the CPU under the shim of tests/cuda_emu.py with QPN_MMA = 2, against the torch reference:
NVFP4 and FP8 slots, 1 and 5 tokens, misses (pairs with no slot), a slot listed active with no rows, K split over
warps. The ordered form (HYBRID_MOE_REDUCE=ordered) gives the same bits whichever order its blocks run in (the
emulation runs them forward and in reverse: another block is the last of its column group) and leaves its counters
zero for the next launch; its serial walk (more hit pairs than its shared memory holds) gives the same bits as its
usual sum; the atomic form sums in the blocks' order. The real atomics and fences are checked on a
GPU (tests/test_qpn_cuda.py)."""
import ctypes

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build, layout
from hybrid.kernels.driver import ptr
from tests.cuda_emu import GEMM_HELPERS, SHFL_XOR, SHIM, compile_emu, mma_shim, qpn_preamble
from tests.test_qpn_layout import fp8, nvfp4

HELPERS = GEMM_HELPERS + SHFL_XOR + r"""
inline void pdl_wait() {}
inline void pdl_trigger() {}
inline u64 ld_act(const u16* p) { u64 v; memcpy(&v, p, 8); return v; }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
// down_body's cp.async branch (ST > 0), never instantiated here
template <int FMT, int MT, int NT, int ST>
void warp_gemm_async(float (&)[NT][MT][ACCN], const u32x4* const (&)[NT], const u64* const (&)[NT], int, int,
                     const u16* const (&)[MT], int, unsigned char*);
""" + mma_shim("mma_tile")
FUNCS = ["dec_fp4", "dec_fp8", "lane_tok", "lane_k", "lane_src", "mma_group", "group_fp4", "group_fp8", "load_x",
         "chunk", "load_stage", "warp_gemm", "store_partials", "red_sum", "zero_acc", "last_arrival", "moe_ordered_sum",
         "down_body"]
ARGS = ("const u32x4* w, const u64* s, const float* gs, long long ws, long long ss, const u16* h, const int* tok, "
        "const float* rw, const int* off, const int* perm, const int* act, float* y, float* part, int* done, int H, "
        "int I, int KS")


def emu_source(pairs: int | None = None) -> str:
    """The emulation's C++; `pairs`: moe_ordered_sum's shared-memory room for hit pairs in place of the kernel's
    (fewer than a step has: its serial walk)."""
    src = build.source()
    if pairs is not None:
        assert src.count("constexpr int PAIRS = 256;") == 1
        src = src.replace("constexpr int PAIRS = 256;", f"constexpr int PAIRS = {pairs};")
    pre = qpn_preamble(src)
    funcs = build.device_functions(FUNCS, src)
    assert "asm" not in pre[pre.index("#define BULK_SLOT"):] + funcs, "an inline-PTX helper the shim does not replace"
    entry = "".join(
        f'extern "C" void emu_down_{f}{"_ord" if o else ""}(int gx, int gy, int reverse, {ARGS}) {{ '
        f'run_grid(gx, gy, THREADS, [&] {{ down_body<{f}, 1, 0, {"true" if o else "false"}>(w, s, gs, ws, ss, h, '
        f'tok, rw, off, perm, act, y, part, done, H, I, KS); }}, 1, reverse); }}\n'
        for f in (2, 8) for o in (False, True))
    return SHIM + "#define __CUDA_ARCH__ 900\n#include <cstdlib>\n" + pre + HELPERS + funcs + entry


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "qpn_moe_down_emu", emu_source())


@pytest.fixture(scope="module")
def emu_serial(tmp_path_factory):
    """moe_ordered_sum with room for 2 pairs: every test step takes its serial walk."""
    return compile_emu(tmp_path_factory, "qpn_moe_down_emu_serial", emu_source(pairs=2))


def routing(t, k, s, misses, seed):
    """Pairs a = token * k + j -> (slot_ids, token_idx, route_w) and qpn_moe_route's grouping: offsets [S + 1], perm
    (a slot's pairs in a shuffled order, as the route kernel's atomics may leave them), active (the slots with
    rows, in slot order, -1 after; one slot listed with no rows when there is room)."""
    g = torch.Generator().manual_seed(seed)
    slot_ids = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]).flatten().int()
    slot_ids[torch.randperm(t * k, generator=g)[:misses]] = -1
    token_idx = torch.arange(t * k, dtype=torch.int32) // k
    route_w = torch.rand(t * k, generator=g)
    counts = torch.bincount(slot_ids[slot_ids >= 0].long(), minlength=s)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    perm = torch.cat([torch.nonzero(slot_ids == j).flatten()[torch.randperm(int(counts[j]), generator=g)]
                      for j in range(s)]).int()
    rows = min(t * k, s)
    used = [j for j in range(s) if counts[j] > 0]
    empty = [j for j in range(s) if counts[j] == 0]
    listed = (used + empty[:1])[:rows] if len(used) < rows else used[:rows]
    active = torch.tensor(sorted(listed) + [-1] * (rows - len(listed)), dtype=torch.int32)
    return slot_ids, token_idx, route_w, offsets, perm, active


def run_down(lib, qws, h_rows, route, t, ks, ordered, reverse):
    """y [T, H] (zeroed first, as the route kernel does) from the emulated down kernel; part poisoned (NaN), done
    zero -> (y, done after)."""
    i = ctypes.c_int
    slot_ids, token_idx, route_w, offsets, perm, active = route
    qt = qws[0].qtype
    hdim, idim = qws[0].shape
    packs = [layout.pack_nvfp4(q) if qt is QType.NVFP4 else (layout.pack_fp8(q), torch.zeros(8, dtype=torch.uint8))
             for q in qws]
    words = torch.stack([p[0].contiguous().view(-1) for p in packs])
    scales = torch.stack([p[1].contiguous().view(-1) for p in packs])
    gs = torch.tensor([[0.0, 0.0, layout.global_scale(q)] for q in qws], dtype=torch.float32)
    ws, ss = words.shape[1] // 4, scales.shape[1] // 8          # u32x4 / u64 units
    y = torch.zeros(t, hdim)
    a = slot_ids.shape[0]
    part = torch.full((a, hdim), float("nan"))
    groups = -(-(hdim // 16) // (8 // ks))
    done = torch.zeros(groups, dtype=torch.int32)
    fmt = 2 if qt is QType.NVFP4 else 8
    getattr(lib, f"emu_down_{fmt}{'_ord' if ordered else ''}")(
        i(groups), i(active.shape[0]), i(int(reverse)), ptr(words), ptr(scales), ptr(gs), ctypes.c_longlong(ws),
        ctypes.c_longlong(ss), ptr(h_rows), ptr(token_idx), ptr(route_w), ptr(offsets), ptr(perm), ptr(active),
        ptr(y), ptr(part), ptr(done), i(hdim), i(idim), i(ks))
    return y, done


@pytest.mark.parametrize("qtype,hdim,idim,t,k,s,misses,ks", [
    (QType.NVFP4, 64, 128, 1, 4, 6, 0, 1),      # one token, every pair in a slot
    (QType.NVFP4, 48, 256, 1, 4, 8, 1, 2),      # a miss; K split over 2 warps; 3 column tiles (a group part-filled)
    (QType.NVFP4, 32, 192, 5, 3, 4, 2, 4),      # 5 tokens over 4 slots: several rows per slot, shuffled
    (QType.FP8, 64, 96, 2, 2, 5, 1, 1),         # FP8: 3 chunks of 32 k; a slot listed with no rows
])
def test_emulated_moe_down(emu, emu_serial, qtype, hdim, idim, t, k, s, misses, ks):
    make = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype]
    qws = [make(hdim, idim, seed=10 * j + hdim) for j in range(s)]
    route = routing(t, k, s, misses, seed=hdim + t)
    slot_ids, token_idx, route_w, offsets, perm, active = route
    h_rows = (torch.randn(slot_ids.shape[0], idim, generator=torch.Generator().manual_seed(ks)) / 4).half()
    ref = torch.zeros(t, hdim, dtype=torch.float64)
    for r, a in enumerate(perm.tolist()):                 # h row r belongs to pair perm[r]
        w = qws[int(slot_ids[a])].dequantize(torch.float64)
        ref[int(token_idx[a])] += float(route_w[a]) * (h_rows[r].double() @ w.t())
    got = {}
    for ordered in (False, True):
        for reverse in (False, True):
            y, done = run_down(emu, qws, h_rows, route, t, ks, ordered, reverse)
            assert not torch.isnan(y).any(), "a partial read before it was written"
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-3, f"ordered={ordered} reverse={reverse}: relative error {err:.2e}"
            if ordered:
                assert (done == 0).all(), "the column groups' counters must be left zero"
            got[ordered, reverse] = y
    assert torch.equal(got[True, False], got[True, True]), "the ordered sum depends on the blocks' order"
    serial, done = run_down(emu_serial, qws, h_rows, route, t, ks, True, True)
    assert (done == 0).all()
    assert torch.equal(serial, got[True, False]), "the serial walk and the shared-memory sum add in another order"


def test_moe_workspace_grows_only():
    """The ordered kernel's workspace: room for at least MOE_ORDERED_MIN_PAIRS pairs at first use, kept while it
    fits, replaced by a larger one when a launch needs more (the old buffers kept: captured graphs point at them),
    counters zero."""
    from hybrid.kernels import qpn

    dev = torch.device("cpu")
    qpn._MOE_WORK.pop(dev, None)
    try:
        part, done = qpn._moe_workspace(dev, 8, 64, 3)
        assert part.numel() == qpn.MOE_ORDERED_MIN_PAIRS * 64 and done.numel() == 3 and not done.any()
        assert qpn._moe_workspace(dev, 8, 64, 2)[0] is part                     # fits: the same buffers
        big, done2 = qpn._moe_workspace(dev, qpn.MOE_ORDERED_MIN_PAIRS + 1, 64, 5)
        assert big.numel() == (qpn.MOE_ORDERED_MIN_PAIRS + 1) * 64 and done2.numel() == 5 and not done2.any()
        assert any(t is part for t in qpn._MOE_WORK[dev][2])                    # the old one kept alive
    finally:
        qpn._MOE_WORK.pop(dev, None)

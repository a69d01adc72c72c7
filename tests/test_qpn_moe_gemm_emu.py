"""The MoE prefill grouped GEMM of cuda/qpn.cu (qpn{2,8}_moe_gemm_{gateup,down}_<BM>x<BN>) run on the
CPU under tests/cuda_emu.py (the WMMA GEMM's shim of tests/test_qpn_gemm_emu.py: a block's threads as
OS threads, WMMA with the shim's own fragment layout) against the torch reference: NVFP4 and FP8
slots with uneven row counts (0, 1, BM - 1, BM + 3, 2 BM + 2), tokens in odd orders within a slot,
dropped assignments, an empty slot listed active, outputs poisoned where nothing may be written.
The real WMMA fragments are checked on a GPU (tests/test_qpn_moe_gemm_cuda.py)."""
import ctypes

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build, layout
from hybrid.kernels.qpn import MOE_GEMM_TILES
from hybrid.kernels.reference import ref_moe
from tests.cuda_emu import compile_emu
from tests.test_qpn_gemm_emu import emu_source as gemm_emu_source
from tests.test_qpn_layout import fp8, nvfp4

RULE = "// " + "-" * 64 + " "
EXTRA = r"""
inline float __expf(float v) { return expf(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
"""
TILES = [f"{bm}x{bn}" for bm, bn in MOE_GEMM_TILES]


def emu_source() -> str:
    src = build.source()
    moe = src[src.index(RULE + "MoE prefill: grouped tiled GEMM"): src.index(RULE + "stage pack")]
    assert "asm" not in moe, "an inline-PTX helper the shim does not replace"
    args_gu = ("const u32x4* w, const u64* s, const float* gs, long long ws, long long ss, const u16* x, "
               "const int* tok, const int* off, const int* perm, const int* act, u16* h, int H, int I")
    args_dn = ("const u32x4* w, const u64* s, const float* gs, long long ws, long long ss, const u16* h, "
               "const int* tok, const float* rw, const int* off, const int* perm, const int* act, float* y, "
               "int H, int I")
    entry = "".join(
        f'extern "C" void emu_gateup_{f}_{t}(int gx, int gy, {args_gu}) {{ run_grid(gx, gy, THREADS, [&] {{ '
        f'qpn{f}_moe_gemm_gateup_{t}(w, s, gs, ws, ss, x, tok, off, perm, act, h, H, I); }}); }}\n'
        f'extern "C" void emu_down_{f}_{t}(int gx, int gy, {args_dn}) {{ run_grid(gx, gy, THREADS, [&] {{ '
        f'qpn{f}_moe_gemm_down_{t}(w, s, gs, ws, ss, h, tok, rw, off, perm, act, y, H, I); }}); }}\n'
        for f in (2, 8) for t in TILES)
    return gemm_emu_source() + EXTRA + moe + entry


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return compile_emu(tmp_path_factory, "qpn_moe_gemm_emu", emu_source())


def pack_slots(experts, qtype):
    """Per-slot packed w13 / w2 (+ scales) and gs [S, 3], as QPNExpertSlots.load lays them out."""
    w13, s13, w2, s2, gs = [], [], [], [], []
    for gate, up, down in experts:
        if qtype is QType.NVFP4:
            (wg, sg), (wu, su), (wd, sd) = (layout.pack_nvfp4(q) for q in (gate, up, down))
            s13.append(torch.cat([sg, su])), s2.append(sd)
        else:
            wg, wu, wd = (layout.pack_fp8(q) for q in (gate, up, down))
        w13.append(torch.cat([wg, wu])), w2.append(wd)
        gs.append(torch.tensor([layout.global_scale(q) for q in (gate, up, down)], dtype=torch.float32))
    stack = lambda ts: torch.stack(ts).contiguous() if ts else torch.zeros(16, dtype=torch.uint8)  # noqa: E731
    return stack(w13), stack(s13), stack(w2), stack(s2), torch.stack(gs)


def route(slot_ids, s, g):
    """offsets [S+1], perm [A] (grouped by slot, shuffled within a slot), active [min(A, S)]: what
    qpn_moe_route produces (its within-slot order is arbitrary too)."""
    ids = slot_ids.long()
    valid = (ids >= 0) & (ids < s)
    cnt = torch.bincount(ids[valid], minlength=s)
    offsets = torch.zeros(s + 1, dtype=torch.int32)
    offsets[1:] = cnt.cumsum(0)
    perm = []
    for j in range(s):
        sel = (ids == j).nonzero().flatten()
        perm.append(sel[torch.randperm(len(sel), generator=g)])
    perm = torch.cat(perm).int()
    a = len(slot_ids)
    perm = torch.cat([perm, torch.full((a - len(perm),), -1, dtype=torch.int32)])
    act = [j for j in range(s) if cnt[j] > 0]
    return offsets, perm, act, cnt


@pytest.mark.parametrize("qtype,h,i", [(QType.NVFP4, 192, 128), (QType.FP8, 160, 96)])
@pytest.mark.parametrize("tile", TILES)
def test_emulated_moe_gemm(emu, qtype, h, i, tile):
    bm = int(tile.split("x")[0])
    make = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype]
    counts = [bm + 3, 0, 1, bm - 1, 2 * bm + 2, 5]          # rows per slot; slot 1 empty
    s, t = len(counts), 3 * bm
    g = torch.Generator().manual_seed(bm + h)
    experts = [(make(i, h, seed=10 * j + h), make(i, h, seed=10 * j + 1 + h), make(h, i, seed=10 * j + 2 + h))
               for j in range(s)]
    slot_ids = torch.cat([torch.full((c,), j, dtype=torch.int32) for j, c in enumerate(counts)]
                         + [torch.tensor([-1, s, 7 * s], dtype=torch.int32)])   # dropped by the route
    a = len(slot_ids)
    order = torch.randperm(a, generator=g)
    slot_ids = slot_ids[order].contiguous()
    token_idx = torch.randint(0, t - 3, (a,), generator=g).int()   # the last 3 tokens: never routed
    route_w = torch.rand(a, generator=g)
    x = torch.randn(t, h, generator=g).half() * 4
    offsets, perm, act, cnt = route(slot_ids, s, g)
    active = torch.tensor(act[:1] + [1] + act[1:], dtype=torch.int32)   # an empty slot listed: skipped
    rows = min(a, s) + 1
    active = torch.cat([active, torch.full((rows - len(active),), -1, dtype=torch.int32)])
    w13, s13, w2, s2, gs = pack_slots(experts, qtype)
    ws13, ws2 = w13[0].numel() // 4, w2[0].numel() // 4
    ss13 = s13[0].numel() // 8 if s13.dim() > 1 else 0
    ss2 = s2[0].numel() // 8 if s2.dim() > 1 else 0
    hbuf = torch.full((a, i), float("nan")).half()
    y = torch.zeros(t, h)
    p, ci, ll = (lambda v: ctypes.c_void_p(v.data_ptr())), ctypes.c_int, ctypes.c_longlong
    fmt = 2 if qtype is QType.NVFP4 else 8
    bn = int(tile.split("x")[1])
    getattr(emu, f"emu_gateup_{fmt}_{tile}")(ci(-(-i // (bn // 2))), ci(rows), p(w13), p(s13), p(gs), ll(ws13),
                                             ll(ss13), p(x), p(token_idx), p(offsets), p(perm), p(active),
                                             p(hbuf), ci(h), ci(i))
    nv = int(offsets[s])
    assert torch.isnan(hbuf[nv:]).all(), "h written past the routed rows"
    assert not torch.isnan(hbuf[:nv]).any(), "unwritten h rows"
    # gate+up against the dequantized weights, per routed row in perm order
    for j in range(s):
        if not cnt[j]:
            continue
        sel = perm[offsets[j]: offsets[j + 1]].long()
        xr = x[token_idx[sel].long()].double()
        gate, up = (xr @ q.dequantize(torch.float64).t() for q in experts[j][:2])
        ref = torch.nn.functional.silu(gate) * up
        got = hbuf[offsets[j]: offsets[j + 1]].double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"slot {j} gate+up: relative error {err:.2e}"
    getattr(emu, f"emu_down_{fmt}_{tile}")(ci(-(-h // bn)), ci(rows), p(w2), p(s2), p(gs), ll(ws2), ll(ss2),
                                           p(hbuf), p(token_idx), p(route_w), p(offsets), p(perm), p(active),
                                           p(y), ci(h), ci(i))
    assert torch.isfinite(y).all()
    assert (y[t - 3:] == 0).all(), "unrouted tokens written"
    keep = (slot_ids >= 0) & (slot_ids < s)
    ref = ref_moe(x, experts, slot_ids[keep], token_idx[keep], route_w[keep]).double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 3e-3, f"{qtype.value} {tile}: relative error {err:.2e}"


def test_launcher_rule(monkeypatch):
    """qpn_moe takes the grouped GEMM only when on and from MOE_GEMM_MIN_ROWS average rows per block
    row (A / min(A, S)); BM = 64 from MOE_GEMM_BM64_ROWS."""
    from hybrid.kernels import qpn

    monkeypatch.setattr(qpn, "MOE_GEMM", [False])
    assert qpn.moe_gemm_tile(4096, 128) is None                      # off by default
    monkeypatch.setattr(qpn, "MOE_GEMM", [True])
    assert qpn.moe_gemm_tile(4096, 128) == (32, 128)                 # 512 tokens x top-8 of 128: 32 rows
    assert qpn.moe_gemm_tile(8 * 1024, 128) == (64, 128)             # 1024 tokens: 64 rows
    assert qpn.moe_gemm_tile(1024, 128) is None                      # 128 tokens: 8 rows, the mt4 kernels
    assert qpn.moe_gemm_tile(8, 128) is None and qpn.moe_gemm_tile(0, 128) is None
    assert all(t in qpn.MOE_GEMM_TILES for t in ((32, 128), (64, 128)))

"""The MoE prefill grouped GEMMs of cuda/qpn.cu run on the CPU against the torch reference: the WMMA
family qpn{2,8}_moe_gemm_{gateup,down}_<BM>x128 under the shim of tests/test_qpn_gemm_emu.py (a
block's threads as OS threads, WMMA with the shim's own fragment layout) and the sm_80+ family
qpn{2,8}_moe_gemmf_{gateup_<BM>x256,down_<BM>x128} under that of tests/test_qpn_gemmf_emu.py (mma.sync
m16n8k16 with the PTX ISA's fragment layout, cp.async as a copy). NVFP4 and FP8 slots with uneven row
counts (0, 1, BM - 1, BM + 3, 2 BM + 2), tokens in odd orders within a slot, dropped assignments, an
empty slot listed active, outputs poisoned where nothing may be written. The real tensor cores are
checked on a GPU (tests/test_qpn_moe_gemm_cuda.py)."""
import ctypes

import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import build, layout
from hybrid.kernels.driver import ptr
from hybrid.kernels.qpn import MOE_GEMM_TILES, MOE_GEMMF_TILES
from hybrid.kernels.reference import ref_moe
from tests.cuda_emu import compile_emu
from tests.test_qpn_gemm_emu import emu_source as gemm_emu_source
from tests.test_qpn_gemmf_emu import emu_source as gemmf_emu_source
from tests.test_qpn_layout import fp8, nvfp4

RULE = "// " + "-" * 64 + " "
EXTRA = r"""
inline float __expf(float v) { return expf(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline void red_add4(float* p, float a, float b, float c, float d) {
  atomicAdd(p, a), atomicAdd(p + 1, b), atomicAdd(p + 2, c), atomicAdd(p + 3, d);
}
"""
# family -> (the kernel source's section, its base emulation, kernel names by BM, h columns per gate+up block)
FAMILIES = {
    "wmma": ("MoE prefill: grouped tiled GEMM", gemm_emu_source,
             {bm: (f"moe_gemm_gateup_{bm}x{bn}", f"moe_gemm_down_{bm}x{bn}") for bm, bn in MOE_GEMM_TILES}, 64),
    "gemmf": ("MoE prefill: grouped GEMM, sm_80+", gemmf_emu_source,
              {bm: (f"moe_gemmf_gateup_{bm}x256", f"moe_gemmf_down_{bm}x128") for bm in MOE_GEMMF_TILES}, 128),
}
ARGS_GU = ("const u32x4* w, const u64* s, const float* gs, long long ws, long long ss, const u16* x, "
           "const int* tok, const int* off, const int* perm, const int* act, u16* h, int H, int I")
ARGS_DN = ("const u32x4* w, const u64* s, const float* gs, long long ws, long long ss, const u16* h, "
           "const int* tok, const float* rw, const int* off, const int* perm, const int* act, float* y, int H, int I")


def emu_source(family: str) -> str:
    title, base, names, _ = FAMILIES[family]
    src = build.source()
    start = src.index(RULE + title)
    sec = src[start: src.index(RULE, start + len(RULE))]
    assert "asm" not in sec, "an inline-PTX helper the shim does not replace"
    entry = "".join(
        f'extern "C" void emu_gateup_{f}_{bm}(int gx, int gy, int gz, {ARGS_GU}) {{ run_grid(gx, gy, THREADS, [&] {{ '
        f'qpn{f}_{gu}(w, s, gs, ws, ss, x, tok, off, perm, act, h, H, I); }}, gz); }}\n'
        f'extern "C" void emu_down_{f}_{bm}(int gx, int gy, int gz, {ARGS_DN}) {{ run_grid(gx, gy, THREADS, [&] {{ '
        f'qpn{f}_{dn}(w, s, gs, ws, ss, h, tok, rw, off, perm, act, y, H, I); }}, gz); }}\n'
        for f in (2, 8) for bm, (gu, dn) in names.items())
    return base() + EXTRA + sec + entry


@pytest.fixture(scope="module", params=list(FAMILIES))
def emu(request, tmp_path_factory):
    return request.param, compile_emu(tmp_path_factory, f"qpn_moe_{request.param}_emu", emu_source(request.param))


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
    """offsets [S+1], perm [A] (grouped by slot, shuffled within a slot; -1 past the routed ones), the
    active slots and per-slot counts: what qpn_moe_route produces (its within-slot order is arbitrary)."""
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
    perm = torch.cat([perm, torch.full((len(slot_ids) - len(perm),), -1, dtype=torch.int32)])
    return offsets, perm, [j for j in range(s) if cnt[j] > 0], cnt


@pytest.mark.parametrize("qtype,h,i", [(QType.NVFP4, 192, 128), (QType.FP8, 160, 96)])
@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("gz", [1, 2], ids=["z1", "z2"])
def test_emulated_moe_gemm(emu, qtype, h, i, bm, gz):
    family, lib = emu
    hcols = FAMILIES[family][3]
    make = {QType.NVFP4: nvfp4, QType.FP8: fp8}[qtype]
    counts = [bm + 3, 0, 1, bm - 1, 2 * bm + 2, 5]          # rows per slot; slot 1 empty
    s, t = len(counts), 3 * bm
    g = torch.Generator().manual_seed(bm + h)
    experts = [(make(i, h, seed=10 * j + h), make(i, h, seed=10 * j + 1 + h), make(h, i, seed=10 * j + 2 + h))
               for j in range(s)]
    slot_ids = torch.cat([torch.full((c,), j, dtype=torch.int32) for j, c in enumerate(counts)]
                         + [torch.tensor([-1, s, 7 * s], dtype=torch.int32)])   # dropped by the route
    a = len(slot_ids)
    slot_ids = slot_ids[torch.randperm(a, generator=g)].contiguous()
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
    p, ci, ll = ptr, ctypes.c_int, ctypes.c_longlong
    fmt = 2 if qtype is QType.NVFP4 else 8
    getattr(lib, f"emu_gateup_{fmt}_{bm}")(ci(-(-i // hcols)), ci(rows), ci(gz), p(w13), p(s13), p(gs), ll(ws13),
                                           ll(ss13), p(x), p(token_idx), p(offsets), p(perm), p(active), p(hbuf),
                                           ci(h), ci(i))
    nv = int(offsets[s])
    assert torch.isnan(hbuf[nv:]).all(), "h written past the routed rows"
    assert not torch.isnan(hbuf[:nv]).any(), "unwritten h rows"
    for j in range(s):   # gate+up against the dequantized weights, per routed row in perm order
        if not cnt[j]:
            continue
        sel = perm[offsets[j]: offsets[j + 1]].long()
        xr = x[token_idx[sel].long()].double()
        gate, up = (xr @ q.dequantize(torch.float64).t() for q in experts[j][:2])
        ref = torch.nn.functional.silu(gate) * up
        got = hbuf[offsets[j]: offsets[j + 1]].double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"{family} slot {j} gate+up: relative error {err:.2e}"
    getattr(lib, f"emu_down_{fmt}_{bm}")(ci(-(-h // 128)), ci(rows), ci(gz), p(w2), p(s2), p(gs), ll(ws2), ll(ss2),
                                         p(hbuf), p(token_idx), p(route_w), p(offsets), p(perm), p(active),
                                         p(y), ci(h), ci(i))
    assert torch.isfinite(y).all()
    assert (y[t - 3:] == 0).all(), "unrouted tokens written"
    keep = (slot_ids >= 0) & (slot_ids < s)
    ref = ref_moe(x, experts, slot_ids[keep], token_idx[keep], route_w[keep]).double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 3e-3, f"{family} {qtype.value} BM={bm}: relative error {err:.2e}"


def test_launcher_rule(monkeypatch):
    """qpn_moe takes a grouped GEMM unless off (MOE_GEMM None / "0"): "auto" (the default) the gemmf family on
    sm_80+, WMMA below; "f" / "1" pick the family (f below sm_80: WMMA); from MOE_GEMM_RULES' fewest average
    rows per block row (A / min(A, S)), BM = 64 from its BM-64 rows."""
    from hybrid.kernels import qpn

    plan = qpn.moe_gemm_plan
    for off in (None, "0"):
        monkeypatch.setattr(qpn, "MOE_GEMM", [off])
        assert plan(4096, 128, 2, 70, 2048, 768) is None
    monkeypatch.setattr(qpn, "MOE_GEMM", ["auto"])
    # top-8 of 128 experts: 32 tokens = 2 rows per slot -> gemmf on sm_80+; Volta NVFP4: WMMA from 64 rows
    assert plan(256, 128, 2, 90, 2048, 768) == ("qpn2_moe_gemmf_gateup_32x256", 6, "qpn2_moe_gemmf_down_32x128", 16, 32)
    assert plan(72, 128, 2, 90, 2048, 768)[0] == "qpn2_moe_gemmf_gateup_32x256"   # 9 tokens (qpn_moe: t > 8)
    assert plan(16384, 128, 2, 90, 2048, 768)[0] == "qpn2_moe_gemmf_gateup_32x256"   # NVFP4 gemmf: BM 32 always
    assert plan(8192, 128, 8, 90, 2048, 768)[0:3:2] == ("qpn8_moe_gemmf_gateup_64x256", "qpn8_moe_gemmf_down_64x128")
    assert plan(4096, 128, 8, 90, 2048, 768)[0] == "qpn8_moe_gemmf_gateup_32x256"
    assert plan(4096, 128, 2, 70, 2048, 768) is None                     # 512 tokens on Volta, NVFP4: mt4
    assert plan(8192, 128, 2, 70, 2048, 768) == ("qpn2_moe_gemm_gateup_64x128", 12, "qpn2_moe_gemm_down_64x128", 16, 64)
    assert plan(4096, 128, 8, 70, 2048, 768)[0:3:2] == ("qpn8_moe_gemm_gateup_32x128", "qpn8_moe_gemm_down_32x128")
    assert plan(128, 128, 8, 70, 2048, 768) is None                      # Volta FP8: WMMA from 2 rows
    monkeypatch.setattr(qpn, "MOE_GEMM", ["1"])
    assert plan(8192, 128, 8, 90, 2048, 768)[0:3:2] == ("qpn8_moe_gemm_gateup_64x128", "qpn8_moe_gemm_down_64x128")
    assert plan(8, 128, 2, 70, 2048, 768) is None and plan(0, 128, 2, 70, 2048, 768) is None
    monkeypatch.setattr(qpn, "MOE_GEMM", ["f"])
    assert plan(512, 128, 2, 70, 2048, 768) is None                      # Volta: the WMMA family's rule
    assert plan(8192, 128, 2, 70, 2048, 768)[0] == "qpn2_moe_gemm_gateup_64x128"
    monkeypatch.setattr(qpn, "MOE_GEMM", ["yes"])
    from hybrid.errors import HybridError

    with pytest.raises(HybridError, match="HYBRID_MOE_GEMM='yes': expected auto, 0"):
        plan(4096, 128, 2, 90, 2048, 768)
    names = set(build.KERNELS)
    for choice, sm in (("1", 70), ("f", 90), ("auto", 70), ("auto", 90)):
        monkeypatch.setattr(qpn, "MOE_GEMM", [choice])
        for a in (8192, 16384):
            for fmt in (2, 8):
                gu, _, dn, _, _ = plan(a, 128, fmt, sm, 2048, 768)
                assert {gu, dn} <= names, "a kernel the compile check does not list"


@pytest.mark.parametrize("env,mode", [(None, "auto"), ("0", None), ("f", "f"), ("", "auto")])
def test_env_default(env, mode):
    """$HYBRID_MOE_GEMM sets the initial choice: unset (or empty) is auto, 0 is off."""
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k != "HYBRID_MOE_GEMM"}
    if env is not None:
        e["HYBRID_MOE_GEMM"] = env
    out = subprocess.run([sys.executable, "-c", "from hybrid.kernels import qpn; print(qpn.moe_gemm_mode())"],
                         env=e, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(mode)

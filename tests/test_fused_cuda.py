"""Fused decode kernels (cuda/fused.cu) on a GPU against their torch references: fresh random inputs,
outputs poisoned with NaN first (the caching allocator hands the poisoned blocks back), odd shapes,
the native build and compute_70 PTX through the driver JIT (the Volta code), one CUDA graph of all
the kernels replayed at several device positions, and the model with HYBRID_FUSED on vs off.

HYBRID_FUSED_TEST_DEVICE=cpu runs this file's logic against the references themselves (a dry run of
the test code on a machine without a GPU); the GPU-only tests skip then."""
import os

import pytest
import torch

from hybrid.kernels import fused, fused_build
from hybrid.model.layers import Rotary

DEV = os.environ.get("HYBRID_FUSED_TEST_DEVICE", "cuda")
GPU = DEV == "cuda"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
gpu_only = pytest.mark.skipif(not GPU, reason="GPU only")
SEED = [2000]
EPS = 1e-6


def fresh(shape, dtype=torch.float32, scale=1.0, shift=0.0):
    SEED[0] += 1
    g = torch.Generator().manual_seed(SEED[0])
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)


def poison(*like):
    """Fill and free blocks of these sizes so that the launcher's torch.empty outputs start as NaN
    (integer outputs as -1)."""
    if GPU:
        blocks = [torch.full(shape, float("nan") if dt.is_floating_point else -1, dtype=dt, device=DEV)
                  for shape, dt in like]
        del blocks


@pytest.fixture(params=["native", "ptx70"])
def backend(request):
    if request.param == "ptx70" and not GPU:
        pytest.skip("GPU only")
    if GPU:
        dev = torch.device("cuda", torch.cuda.current_device())
        if request.param == "ptx70":
            try:
                fused_build.image_for(70, True)
            except Exception as exc:  # noqa: BLE001 - no NVRTC 12 and no prebuilt PTX here
                pytest.skip(f"compute_70 PTX unavailable ({type(exc).__name__}); on the dev machine run "
                            "`python3 -m hybrid.kernels.fused_build --emit DIR` and set HYBRID_CACHE_DIR=DIR here")
        fused.force_ptx(dev, 70 if request.param == "ptx70" else None)
    yield request.param
    if GPU:
        fused.force_ptx(dev, None)


@pytest.fixture(params=["old", "new", "wide"])
def kernels(request, monkeypatch):
    """The older and the newer kernels (HYBRID_FUSED_NEW) of add_norm_router and rope_attn; "wide": every newer
    kernel, fused_rope_attn_w for rope_attn."""
    on = {"old": "0", "new": ",".join(sorted(set(fused.NEW_PARTS) - {"wide"})), "wide": "all"}[request.param]
    monkeypatch.setenv("HYBRID_FUSED_NEW", on)
    return request.param


# ---------------------------------------------------------------------------- add + RMSNorm
@pytest.mark.parametrize("t,h", [(1, 2048), (3, 256), (2, 7), (4, 4100)])
@pytest.mark.parametrize("xdt", [torch.float16, torch.float32])
@pytest.mark.parametrize("ddt", [None, torch.float16, torch.float32])
def test_add_rms_norm(backend, kernels, t, h, xdt, ddt):
    x, w = fresh((t, h), xdt), fresh((h,), scale=0.2, shift=1.0)
    d = fresh((t, h), ddt, scale=0.5) if ddt is not None else None
    poison(((t, h), xdt), ((t, h), xdt), ((t, h), torch.float32))
    x2, hn, hf = fused.add_rms_norm(x.to(DEV), w.to(DEV), EPS, delta=None if d is None else d.to(DEV),
                                    want_f32=True)
    want_x = x + d.to(xdt) if d is not None else x                # torch: one rounding to x's dtype
    assert torch.equal(x2.cpu(), want_x)
    s = want_x.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    tol = 1e-3 if xdt == torch.float16 else 1e-5
    assert hn.dtype == xdt and not torch.isnan(hn).any()
    torch.testing.assert_close(hn.cpu().double(), want, atol=tol, rtol=tol)
    assert torch.equal(hf.cpu(), hn.cpu().float())


# ---------------------------------------------------------------------------- q/k norm + RoPE + KV
@gpu_only
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out", [torch.float16, torch.float32])
@pytest.mark.parametrize("v,h,t", [(40000, 2048, 1), (50, 300, 3), (7, 5, 2)])
def test_embed_rows_from_pinned_host(backend, src, out, v, h, t):
    """The table pinned and mapped on the host (hybrid.runtime.host_embed), ids on the card: the reference's
    rows bit for bit, eagerly and replayed from a CUDA graph with new ids; the card's copy of the table the same;
    an id outside the table a NaN row."""
    from hybrid.runtime.host_embed import HostEmbedding

    table = fresh((v, h), src, scale=4.0)
    he = HostEmbedding.pin(table)
    assert he is not None and he.table is table
    dev = torch.device("cuda", torch.cuda.current_device())
    ids = torch.randint(0, v, (t,), generator=torch.Generator().manual_seed(v + h)).to(dev)
    ids[0] = v - 1
    poison(((t, h), out))
    assert torch.equal(he.rows(ids, out).cpu(), fused.ref_embed_rows(table, ids.cpu(), out))
    assert torch.equal(fused.embed_rows(table.to(dev), ids, out).cpu(), fused.ref_embed_rows(table, ids.cpu(), out))
    static = ids.clone()
    he.rows(static, out)                          # the module loaded before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = he.rows(static, out)
    for seed in (1, 2):
        new = torch.randint(0, v, (t,), generator=torch.Generator().manual_seed(seed))
        static.copy_(new)
        g.replay()
        assert torch.equal(got.cpu(), fused.ref_embed_rows(table, new, out))
    bad = torch.tensor([v, -1][:t] + [0] * max(0, t - 2), device=dev)
    assert he.rows(bad, out)[: min(t, 2)].isnan().all()


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (32, 4, 128), (8, 8, 256), (6, 2, 96), (2, 1, 16)])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("device_pos", [True, False])
def test_qk_rope_kv(backend, hq, hkv, d, t, norm, device_pos):
    cap, start = 64, 37
    qkv = fresh((t, (hq + 2 * hkv) * d), torch.float16)
    qn, kn = (fresh((d,), scale=0.2, shift=1.0), fresh((d,), scale=0.2, shift=1.0)) if norm else (None, None)
    table = Rotary(d, 1e6).table(torch.device("cpu"), 80)
    ks = torch.full((cap, hkv, d), float("nan"), dtype=torch.float16)
    vs = ks.clone()
    rks, rvs = ks.clone(), vs.clone()
    want = fused.ref_qk_rope_kv(qkv, qn, kn, table, rks, rvs, hq, hkv, d, EPS, start=start)
    gks, gvs = ks.to(DEV), vs.to(DEV)
    pos = torch.tensor([start], device=DEV) if device_pos else None
    poison(((t, hq, d), torch.float16))
    q = fused.qk_rope_kv(qkv.to(DEV), None if qn is None else qn.to(DEV), None if kn is None else kn.to(DEV),
                         table.to(DEV), gks, gvs, hq, hkv, d, EPS, pos=pos, start=0 if device_pos else start)
    rows = slice(start, start + t)
    assert q.shape == (t, hq, d) and not torch.isnan(q).any()
    torch.testing.assert_close(q.cpu().float(), want.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(gks[rows].cpu().float(), rks[rows].float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(gvs[rows].cpu(), rvs[rows])
    others = torch.ones(cap, dtype=torch.bool)
    others[rows] = False
    assert torch.isnan(gks[others].float()).all() and torch.isnan(gvs[others].float()).all()


# ---------------------------------------------------------------------------- router
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (7, 32, 4), (3, 512, 8), (2, 60, 1), (4, 8, 8), (1, 256, 32)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_topk(backend, t, e, k, renorm):
    logits = fresh((t, e), scale=3.0)
    poison(((t, k), torch.int64), ((t, k), torch.float32))
    ids, w = fused.route_topk(logits.to(DEV), k, renorm)
    rid, rw = fused.ref_route_topk(logits, k, renorm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), rid)
    torch.testing.assert_close(w.cpu(), rw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (5, 60, 4)])
def test_route_topk_runtime_outputs(backend, t, e, k):
    """slots = slot_table[ids] and the route row (ids as floats, weights), written by the same launch."""
    logits = fresh((t, e), scale=3.0)
    table = torch.randperm(e, generator=torch.Generator().manual_seed(e)).to(torch.int32)
    slots = torch.full((t * k,), -7, dtype=torch.int32, device=DEV)
    row = torch.full((t, 2 * k), float("nan"), device=DEV)
    ids, w = fused.route_topk(logits.to(DEV), k, True, table.to(DEV), slots, row)
    assert torch.equal(slots.cpu(), table[ids.cpu().reshape(-1)])
    assert torch.equal(row[:, :k].cpu(), ids.cpu().float()) and torch.equal(row[:, k:].cpu(), w.cpu())


@pytest.mark.parametrize("t,e,h", [(1, 128, 2048), (3, 60, 256), (8, 512, 100), (2, 8, 4)])
@pytest.mark.parametrize("hdt", [torch.float16, torch.float32])
def test_router_topk(backend, t, e, h, hdt):
    """The router GEMV + softmax / top-k in one launch against the fp32 torch route."""
    k = min(8, e)
    x, w = fresh((t, h), hdt), fresh((e, h), scale=3.0 / h ** 0.5)
    table = torch.randperm(e, generator=torch.Generator().manual_seed(e)).to(torch.int32)
    slots = torch.full((t * k,), -7, dtype=torch.int32, device=DEV)
    row = torch.full((t, 2 * k), float("nan"), device=DEV)
    poison(((t, e), torch.float32), ((t, k), torch.int64), ((t, k), torch.float32))
    outs = [fused.router_topk(x.to(DEV), w.to(DEV), k, True, table.to(DEV), slots, row) for _ in range(2)]
    rid, rw = fused.ref_router_topk(x, w, k, True)
    for ids, wt in outs:                                     # twice: the counter was left at zero
        assert torch.equal(ids.cpu(), rid)
        torch.testing.assert_close(wt.cpu(), rw, atol=1e-5, rtol=1e-4)
    assert torch.equal(slots.cpu(), table[rid.reshape(-1)])
    assert torch.equal(row[:, :k].cpu(), rid.float())


@pytest.mark.parametrize("t,h,e", [(1, 2048, 128), (3, 100, 60), (8, 256, 512), (2, 66, 32), (1, 8192, 64),
                                   (8, 2048, 128), (4, 4096, 160)])
@pytest.mark.parametrize("xdt", [torch.float16, torch.float32])
@pytest.mark.parametrize("ddt", [None, torch.float16, torch.float32])
def test_add_norm_router(backend, kernels, t, h, e, xdt, ddt):
    """Residual add + RMSNorm + router + top-k in one launch: x2 exact, h as the RMSNorm reference,
    ids / weights as the torch route of the h the kernel wrote."""
    k = 8
    x, w = fresh((t, h), xdt), fresh((h,), scale=0.2, shift=1.0)
    d = fresh((t, h), ddt, scale=0.5) if ddt is not None else None
    router = fresh((e, h), scale=3.0 / h ** 0.5)
    row = torch.full((t, 2 * k), float("nan"), device=DEV)
    poison(((t, h), xdt), ((t, h), xdt), ((t, e), torch.float32), ((t, k), torch.int64), ((t, k), torch.float32))
    x2, hn, ids, wt = fused.add_norm_router(x.to(DEV), w.to(DEV), EPS, router.to(DEV), k, True,
                                            None if d is None else d.to(DEV), row=row)
    want_x = x + d.to(xdt) if d is not None else x
    assert torch.equal(x2.cpu(), want_x)
    s = want_x.double()
    want_h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    tol = 1e-3 if xdt == torch.float16 else 1e-5
    torch.testing.assert_close(hn.cpu().double(), want_h, atol=tol, rtol=tol)
    rid, rw = fused.ref_router_topk(hn.cpu(), router, k, True)
    assert torch.equal(ids.cpu(), rid)
    torch.testing.assert_close(wt.cpu(), rw, atol=1e-5, rtol=1e-4)
    assert torch.equal(row[:, k:].cpu(), wt.cpu())


@pytest.mark.parametrize("t,k,e,s", [(1, 8, 128, 128), (1, 8, 128, 24), (4, 8, 64, 64), (8, 4, 32, 7), (2, 8, 16, 1024)])
@pytest.mark.parametrize("planned", [True, False])
def test_add_norm_router_route_plan(backend, monkeypatch, t, k, e, s, planned):
    """The router launch's MoE routing (RoutePlan, HYBRID_FUSED_NEW part "plan"): its buffers as
    ref_route_plan of the slot ids it wrote (absent experts dropped), the output zeroed, and qpn_moe over
    the plan as qpn_moe with its own route launch; with the part off the plan is not made."""
    from hybrid.checkpoint.formats import QType
    from hybrid.kernels import QPNExpertSlots, qpn_moe
    from hybrid.kernels.moe_route import RoutePlan, ref_route_plan
    from tests.test_qpn_layout import nvfp4

    if not planned:
        monkeypatch.setenv("HYBRID_FUSED_NEW", "norm,router,attn")
    h, i = 256, 128
    experts = QPNExpertSlots(s, h, i, QType.NVFP4, DEV)
    for j in range(min(s, 40)):                  # the ids below reach slots < 40 only
        experts.load(j, nvfp4(i, h, seed=3 * j), nvfp4(i, h, seed=3 * j + 1), nvfp4(h, i, seed=3 * j + 2))
    g = torch.Generator().manual_seed(t * 1000 + e + s)
    table = torch.randint(-1, min(s, 40), (e,), generator=g, dtype=torch.int32)
    x, d = fresh((t, h), torch.float16), fresh((t, h), torch.float16, scale=0.5)
    w, router = fresh((h,), scale=0.2, shift=1.0), fresh((e, h), scale=3.0 / h ** 0.5)
    sl = torch.full((t * k,), -7, dtype=torch.int32, device=DEV)
    row = torch.full((t, 2 * k), float("nan"), device=DEV)
    plan = RoutePlan.new(t, k, s, h, DEV)
    for b in (plan.offsets, plan.perm, plan.active):
        b.fill_(-9)
    plan.y.fill_(float("nan"))
    _, hn, ids, wt = fused.add_norm_router(x.to(DEV), w.to(DEV), EPS, router.to(DEV), k, True, d.to(DEV),
                                           table.to(DEV), sl, row, plan=plan)
    assert torch.equal(sl.cpu(), table[ids.cpu().reshape(-1)])
    assert plan.made == planned
    tok = torch.arange(t, dtype=torch.int32, device=DEV).repeat_interleave(k)
    keep = sl >= 0                               # the CPU reference refuses absent slots; the kernels drop them
    want = qpn_moe(hn.half(), experts, sl[keep], tok[keep], wt.reshape(-1)[keep]).cpu()
    if planned:
        offsets, perm, active = ref_route_plan(sl.cpu(), s)
        assert torch.equal(plan.active.cpu(), active)
        for slot in active[active >= 0].tolist():
            assert plan.offsets[slot:slot + 2].cpu().tolist() == offsets[slot:slot + 2].tolist()
        assert torch.equal(plan.perm[: perm.numel()].cpu(), perm)
        assert torch.equal(plan.y.cpu(), torch.zeros(t, h))
    args = (sl, tok, wt.reshape(-1)) if GPU or planned else (sl[keep], tok[keep], wt.reshape(-1)[keep])
    got = qpn_moe(hn.half(), experts, *args, plan=plan)
    assert (got is plan.y) == planned and not plan.made
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * max(want.abs().max().item(), 1e-3))


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (2, 200, 8), (1, 512, 8), (3, 64, 4), (1, 64, 16)])
def test_add_norm_router_ranks_agree(backend, monkeypatch, t, e, k):
    """The router's last block ranked both ways (HYBRID_ROUTE_RANK: rounds, logits; logits is the rounds on the
    compute_70 PTX): the same ids, slots and MoE plan, weights and route rows within 2e-6 (no softmax over all E in
    logits), router rows repeated so that logits tie."""
    from hybrid.kernels.moe_route import RoutePlan

    h = 256
    x, w = fresh((t, h), torch.float16), fresh((h,), scale=0.2, shift=1.0)
    router = fresh((e, h), scale=3.0 / h ** 0.5)
    router[1::3] = router[0::3][: router[1::3].shape[0]]
    table = torch.randperm(e, generator=torch.Generator().manual_seed(e)).to(torch.int32).to(DEV)
    got = {}
    for name in fused.ROUTE_RANKS:
        monkeypatch.setenv("HYBRID_ROUTE_RANK", name)
        sl = torch.full((t * k,), -7, dtype=torch.int32, device=DEV)
        row = torch.full((t, 2 * k), float("nan"), device=DEV)
        plan = RoutePlan.new(t, k, e, h, DEV)
        for b in (plan.offsets, plan.perm, plan.active):
            b.fill_(-9)                          # entries the kernel leaves alone compare equal
        _, hn, ids, wt = fused.add_norm_router(x.to(DEV), w.to(DEV), EPS, router.to(DEV), k, True, None, table, sl,
                                               row, plan=plan)
        got[name] = [a.cpu() for a in (ids, wt, sl, row, plan.offsets, plan.perm, plan.active)]
        _, rw = fused.ref_router_topk(hn.cpu(), router, k, True)
        torch.testing.assert_close(wt.cpu(), rw, atol=1e-5, rtol=1e-4)
    for name, outs in got.items():
        for i, (a, b) in enumerate(zip(outs, got["rounds"])):
            if name == "logits" and i in (1, 3):                 # weights, route rows (ids exact as floats)
                torch.testing.assert_close(a, b, atol=0, rtol=2e-6)
            else:
                assert torch.equal(a.nan_to_num(-5), b.nan_to_num(-5)), name


def test_route_topk_ties_take_lowest_ids(backend):
    ids, w = fused.route_topk(torch.zeros(2, 16, device=DEV), 4, False)
    if GPU:                                   # torch.topk leaves ties unspecified; the kernel does not
        assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w.cpu(), torch.full((2, 4), 1 / 16))


# ---------------------------------------------------------------------------- decode attention
def _keys(p: int, cap: int, bucket: int = 256) -> int:
    return min(-(-(p + 1) // bucket) * bucket, cap)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (32, 4, 128), (16, 1, 128), (8, 8, 256), (12, 4, 40), (2, 1, 16),
                                     (15, 1, 136), (16, 2, 64), (1, 1, 8)])
@pytest.mark.parametrize("p", [0, 5, 15, 16, 31, 32, 63, 64, 127, 128, 300, 1000, 1024, 1500])
def test_decode_attn(backend, hq, hkv, d, p):
    """The bucket (keys a multiple of 256: splits with no keys) and the tight launch (keys = p + 1: one
    split while the keys fit one round (16 / 32 / 64 keys at D 256 / 128 / 64), p = 15 / 16, 31 / 32,
    63 / 64 just inside / past it; p = 1024: two rounds per split at 32 / 4 heads, D 128, 132 SMs)."""
    cap = 1600
    q = fresh((1, hq, d), torch.float16)
    ks, vs = fresh((cap, hkv, d), torch.float16), fresh((cap, hkv, d), torch.float16)
    keys = _keys(p, cap)
    want = fused.ref_decode_attn(q.float(), ks.float(), vs.float(), keys, start=p)
    gq, gks, gvs = q.to(DEV), ks.to(DEV), vs.to(DEV)
    outs = []
    for kw in (dict(pos=torch.tensor([p], device=DEV)), dict(start=p), dict(start=p)):   # counters reset
        poison(((1, hq * d), torch.float16))
        outs.append(fused.decode_attn(gq, gks, gvs, keys, **kw).cpu())
    assert outs[0].shape == (1, hq * d) and not torch.isnan(outs[0]).any()
    torch.testing.assert_close(outs[0].float(), want, atol=2e-3, rtol=2e-3)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    tight = fused.decode_attn(gq, gks, gvs, p + 1, start=p).cpu()     # fewest splits
    torch.testing.assert_close(tight.float(), want, atol=2e-3, rtol=2e-3)
    gqu = torch.empty(hq * d + 1, dtype=torch.float16, device=DEV)[1:].view(1, hq, d).copy_(gq)
    assert torch.equal(fused.decode_attn(gqu, gks, gvs, p + 1, start=p).cpu(), tight)   # q not 16-byte aligned


@pytest.mark.parametrize("p,hq", [(8300, 16), (8300, 4), (4000, 8)])
def test_decode_attn_many_splits(backend, p, hq):
    """Long contexts: splits of many rounds each (online softmax across rounds), up to 64 splits x 16
    heads in the combine."""
    hkv, d, cap = 1, 128, 8320
    q = fresh((1, hq, d), torch.float16)
    ks, vs = fresh((cap, hkv, d), torch.float16), fresh((cap, hkv, d), torch.float16)
    keys = min(-(-(p + 1) // 128) * 128, cap)
    want = fused.ref_decode_attn(q.float(), ks.float(), vs.float(), keys, start=p)
    got = fused.decode_attn(q.to(DEV), ks.to(DEV), vs.to(DEV), keys, pos=torch.tensor([p], device=DEV))
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-3, rtol=2e-3)


@gpu_only
@pytest.mark.parametrize("sms", [1, 3, 8])
@pytest.mark.parametrize("hq,hkv,d,p", [(32, 4, 128, 0), (32, 4, 128, 33), (32, 4, 128, 300), (32, 4, 128, 3000),
                                        (12, 4, 40, 700), (15, 1, 136, 200)])
def test_attn_rounds(monkeypatch, kernels, sms, hq, hkv, d, p):
    """Fewer SMs in the plan: more rounds per split (online softmax across rounds, the next round's
    loads in flight) and splits past the last key, for decode_attn and rope_attn."""
    monkeypatch.setitem(fused._SMS, torch.device("cuda", torch.cuda.current_device()), sms)
    cap = 3100
    q = fresh((1, hq, d), torch.float16)
    ks, vs = fresh((cap, hkv, d), torch.float16), fresh((cap, hkv, d), torch.float16)
    keys = min(_keys(p, cap) + 512, cap)
    want = fused.ref_decode_attn(q.float(), ks.float(), vs.float(), keys, start=p)
    got = fused.decode_attn(q.to(DEV), ks.to(DEV), vs.to(DEV), keys, pos=torch.tensor([p], device=DEV))
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-3, rtol=2e-3)
    qkv = fresh((1, (hq + 2 * hkv) * d), torch.float16)
    qn, kn = fresh((d,), scale=0.2, shift=1.0), fresh((d,), scale=0.2, shift=1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), cap)
    rks, rvs = ks.float(), vs.float()
    want = fused.ref_rope_attn(qkv, qn, kn, table, rks, rvs, hq, hkv, d, EPS, keys, start=p)
    gks, gvs = ks.to(DEV), vs.to(DEV)
    got = fused.rope_attn(*[t.to(DEV) for t in (qkv, qn, kn, table)], gks, gvs, hq, hkv, d, EPS, keys, start=p)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(gvs.cpu().float(), rvs)
    torch.testing.assert_close(gks.cpu().float(), rks, atol=2e-3, rtol=1e-3)


@gpu_only
def test_decode_attn_bad_position_is_nan():
    """A device position < 0 attends no keys: NaN out (as the q of a bad rope position)."""
    q = fresh((1, 8, 64), torch.float16).cuda()
    ks, vs = fresh((512, 2, 64), torch.float16).cuda(), fresh((512, 2, 64), torch.float16).cuda()
    for keys in (16, 512):
        assert torch.isnan(fused.decode_attn(q, ks, vs, keys, pos=torch.tensor([-1], device=DEV))).all()


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (32, 4, 128), (8, 8, 256), (12, 4, 40), (2, 1, 16), (15, 1, 136)])
@pytest.mark.parametrize("p", [0, 31, 32, 64, 127, 128, 300, 1100])
@pytest.mark.parametrize("device_pos", [True, False])
def test_rope_attn_is_rope_then_attn(backend, kernels, hq, hkv, d, p, device_pos):
    """The one-kernel q/k norm + RoPE + KV write + attention against fused_qk_rope_kv then
    fused_decode_attn (the same fp16 q, the same math) and the torch reference."""
    cap = 1600
    qkv = fresh((1, (hq + 2 * hkv) * d), torch.float16)
    qn, kn = fresh((d,), scale=0.2, shift=1.0), fresh((d,), scale=0.2, shift=1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), cap)
    ks, vs = fresh((cap, hkv, d), torch.float16), fresh((cap, hkv, d), torch.float16)
    keys = _keys(p, cap)
    rks, rvs = ks.float(), vs.float()
    want = fused.ref_rope_attn(qkv, qn, kn, table, rks, rvs, hq, hkv, d, EPS, keys, start=p)
    args = [t.to(DEV) for t in (qkv, qn, kn, table)]
    ks1, vs1, ks2, vs2 = ks.to(DEV), vs.to(DEV), ks.to(DEV), vs.to(DEV)
    kw = dict(pos=torch.tensor([p], device=DEV)) if device_pos else dict(start=p)
    poison(((1, hq * d), torch.float16))
    got = fused.rope_attn(*args, ks1, vs1, hq, hkv, d, EPS, keys, **kw)
    q = fused.qk_rope_kv(*args, ks2, vs2, hq, hkv, d, EPS, **kw)
    two = fused.decode_attn(q, ks2, vs2, keys, **kw)
    assert not torch.isnan(got).any()
    assert torch.equal(vs1, vs2)
    # the same code in both (explicit FMAs): expected bit-identical; 1 fp16 ulp allowed for the compiler
    torch.testing.assert_close(ks1.float(), ks2.float(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got.float(), two.float(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-3, rtol=3e-3)


@gpu_only
@pytest.mark.parametrize("min_rounds", [2, 4, 8])
@pytest.mark.parametrize("p", [0, 40, 127, 128, 255, 700, 3000])
def test_rope_attn_fewer_splits(kernels, monkeypatch, min_rounds, p):
    """fused.ATT_MIN_ROUNDS > 1 (fewer, longer splits; one split with keys writes the output itself)."""
    monkeypatch.setattr(fused, "ATT_MIN_ROUNDS", min_rounds)
    hq, hkv, d, cap = 32, 4, 128, 3100
    qkv = fresh((1, (hq + 2 * hkv) * d), torch.float16)
    qn, kn = fresh((d,), scale=0.2, shift=1.0), fresh((d,), scale=0.2, shift=1.0)
    table = Rotary(d, 1e6).table(torch.device("cpu"), cap)
    ks, vs = fresh((cap, hkv, d), torch.float16), fresh((cap, hkv, d), torch.float16)
    keys = _keys(p, cap)
    rks, rvs = ks.float(), vs.float()
    want = fused.ref_rope_attn(qkv, qn, kn, table, rks, rvs, hq, hkv, d, EPS, keys, start=p)
    gks, gvs = ks.to(DEV), vs.to(DEV)
    poison(((1, hq * d), torch.float16))
    got = fused.rope_attn(*[t.to(DEV) for t in (qkv, qn, kn, table)], gks, gvs, hq, hkv, d, EPS, keys,
                          pos=torch.tensor([p], device=DEV))
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(gvs.cpu().float(), rvs)
    torch.testing.assert_close(gks.cpu().float(), rks, atol=2e-3, rtol=1e-3)


@gpu_only
def test_rope_attn_bad_position_is_nan(kernels):
    """A device position outside the RoPE table: NaN out, no K/V row written."""
    hq, hkv, d = 8, 2, 64
    qkv = fresh((1, (hq + 2 * hkv) * d), torch.float16).cuda()
    qn, kn = fresh((d,), shift=1.0).cuda(), fresh((d,), shift=1.0).cuda()
    table = Rotary(d, 1e6).table(torch.device("cuda"), 100)
    ks, vs = fresh((512, hkv, d), torch.float16).cuda(), fresh((512, hkv, d), torch.float16).cuda()
    ks0, vs0 = ks.clone(), vs.clone()
    for p in (-1, 150):
        out = fused.rope_attn(qkv, qn, kn, table, ks, vs, hq, hkv, d, EPS, 256, pos=torch.tensor([p], device=DEV))
        assert torch.isnan(out).all()
    assert torch.equal(ks, ks0) and torch.equal(vs, vs0)


@gpu_only
def test_decode_attn_matches_torch_sdpa():
    """The kernel against the torch path it replaces (Attention._sdpa1 with the additive mask)."""
    from hybrid.model.layers import Attention, decode_mask

    hq, hkv, d, cap, p = 32, 4, 128, 1024, 700
    attn = Attention(None, None, None, None, hq, hkv, d, None, None, EPS)
    q = fresh((1, hq, d), torch.float16).cuda()
    ks, vs = fresh((cap, hkv, d), torch.float16).cuda(), fresh((cap, hkv, d), torch.float16).cuda()
    keys = _keys(p, cap)
    want = attn._sdpa1(q, ks[:keys], vs[:keys], decode_mask(p, keys, torch.float16, "cuda"))
    got = fused.decode_attn(q, ks, vs, keys, start=p)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------- bad input
def test_odd_shapes_rejected():
    f16 = dict(dtype=torch.float16, device=DEV)
    if not GPU:
        pytest.skip("the checks guard the kernels (CPU tensors take the references)")
    table = torch.zeros(8, 2, 15, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        fused.qk_rope_kv(torch.zeros(1, 4 * 15, **f16), None, None, table, torch.zeros(8, 1, 15, **f16),
                         torch.zeros(8, 1, 15, **f16), 2, 1, 15, EPS, start=0)
    with pytest.raises(ValueError, match="outside the KV store"):
        t16 = torch.zeros(8, 2, 16, device=DEV)
        fused.qk_rope_kv(torch.zeros(1, 4 * 16, **f16), None, None, t16, torch.zeros(8, 1, 16, **f16),
                         torch.zeros(8, 1, 16, **f16), 2, 1, 16, EPS, start=8)
    with pytest.raises(ValueError, match="at most 512 experts"):
        fused.route_topk(torch.zeros(1, 513, device=DEV), 2, True)
    with pytest.raises(ValueError, match="k: expected"):
        fused.route_topk(torch.zeros(1, 64, device=DEV), 33, True)
    with pytest.raises(ValueError, match="tokens and H % 4"):
        fused.router_topk(torch.zeros(9, 64, **f16), torch.zeros(8, 64, device=DEV), 2, True)
    with pytest.raises(ValueError, match="tokens and H % 4"):
        fused.router_topk(torch.zeros(1, 66, **f16), torch.zeros(8, 66, device=DEV), 2, True)
    with pytest.raises(ValueError, match="tokens of H <= 8192"):
        fused.add_norm_router(torch.zeros(1, 8200, **f16), torch.zeros(8200, device=DEV), EPS,
                              torch.zeros(8, 8200, device=DEV), 2, True)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        fused.route_topk(torch.zeros(1, 64, **f16), 2, True)
    with pytest.raises(ValueError, match="not supported"):
        fused.decode_attn(torch.zeros(1, 17, 16, **f16), torch.zeros(8, 1, 16, **f16), torch.zeros(8, 1, 16, **f16), 8)
    with pytest.raises(ValueError, match="not supported"):
        fused.decode_attn(torch.zeros(1, 4, 20, **f16), torch.zeros(8, 2, 20, **f16), torch.zeros(8, 2, 20, **f16), 8)
    with pytest.raises(ValueError, match="keys"):
        fused.decode_attn(torch.zeros(1, 4, 16, **f16), torch.zeros(8, 2, 16, **f16), torch.zeros(8, 2, 16, **f16), 9)
    with pytest.raises(ValueError, match="weight: expected dtype"):
        fused.add_rms_norm(torch.zeros(1, 16, **f16), torch.zeros(16, **f16), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        fused.add_rms_norm(torch.zeros(16, 2, **f16).t(), torch.zeros(16, device=DEV), EPS)


# ---------------------------------------------------------------------------- CUDA graph
@gpu_only
def test_graph_capture_and_replay(kernels):
    """All seven kernels captured once (position a device tensor) and replayed at several positions
    give what the same calls give eagerly (bit-identical: the same kernels)."""
    hdim, hq, hkv, d, e, k, cap, keys = 256, 8, 2, 64, 32, 4, 512, 512
    dev = torch.device("cuda")
    w = fresh((hdim,), scale=0.2, shift=1.0).cuda()
    qn, kn = fresh((d,), shift=1.0).cuda(), fresh((d,), shift=1.0).cuda()
    table = Rotary(d, 1e6).table(dev, cap)
    x, delta = torch.zeros(1, hdim, dtype=torch.float16, device=dev), torch.zeros(1, hdim, dtype=torch.float16, device=dev)
    qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=torch.float16, device=dev)
    logits = torch.zeros(1, e, device=dev)
    router = fresh((e, hdim), scale=3.0 / hdim ** 0.5).cuda()
    ks, vs = fresh((cap, hkv, d), torch.float16).cuda(), fresh((cap, hkv, d), torch.float16).cuda()
    pos = torch.zeros(1, dtype=torch.int64, device=dev)

    def body():
        x2, h, hf = fused.add_rms_norm(x, w, EPS, delta=delta, want_f32=True)
        q = fused.qk_rope_kv(qkv, qn, kn, table, ks, vs, hq, hkv, d, EPS, pos=pos)
        o = fused.decode_attn(q, ks, vs, keys, pos=pos)
        ids, rw = fused.route_topk(logits, k, True)
        rids, rrw = fused.router_topk(h, router, k, True)
        ax, ah, aids, aw = fused.add_norm_router(x, w, EPS, router, k, True, delta)
        ro = fused.rope_attn(qkv, qn, kn, table, ks, vs, hq, hkv, d, EPS, keys, pos=pos)
        return x2, h, hf, q, o, ids, rw, rids, rrw, ax, ah, aids, aw, ro

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()                                                   # build, workspace
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = body()
    for p in (3, 200, 511, 0):
        for buf, src in ((x, fresh((1, hdim), torch.float16)), (delta, fresh((1, hdim), torch.float16)),
                         (qkv, fresh(tuple(qkv.shape), torch.float16)), (logits, fresh((1, e), scale=3.0))):
            buf.copy_(src)
        pos.fill_(p)
        graph.replay()
        got = [t.clone() for t in static]
        want = body()
        names = ("x", "h", "hf", "q", "attn", "ids", "weights", "router ids", "router weights",
                 "anr x", "anr h", "anr ids", "anr weights", "rope_attn")
        for name, a, b in zip(names, got, want):
            assert torch.equal(a, b), f"pos {p}: {name} differs between replay and eager"


# ---------------------------------------------------------------------------- the model, on vs off
@gpu_only
def test_model_fused_vs_torch_ops(qwen3_dir, monkeypatch):
    """The reference model on CUDA (eager path: prefill, then one-token steps) with HYBRID_FUSED=1
    against HYBRID_FUSED=0: teacher-forced logits agree within fp16 noise."""
    from hybrid.model.loader import load_model

    ids = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(3))
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("HYBRID_FUSED", flag)
        m = load_model(qwen3_dir, device="cuda")
        m.new_cache(32)
        rows = [m.forward(ids[:16], 0)]
        for j in range(16, 24):
            rows.append(m.forward(ids[j:j + 1], j))
        runs.append(torch.cat(rows).cpu())
    off, on = runs
    assert (off.argmax(-1) == on.argmax(-1)).float().mean() >= 0.9
    # a near-tie in a router may pick another expert for one token: judge the rows, not the worst one
    close = ((on - off).abs().amax(-1) <= 5e-2 * off.abs().amax(-1).clamp_min(1)).float().mean()
    assert close >= 0.9, f"only {close:.0%} of the rows agree within 5e-2"


@gpu_only
def test_decode_dense_residual_and_route_out(qwen3_dir):
    """On CUDA, decode_dense(x, residual=r, route_out=...) is decode_dense(x + r) (the same kernels),
    and the router launch fills the runtime's slot ids and route row."""
    from hybrid.model.loader import load_model
    from hybrid.model.qwen_moe import RouteOut

    m = load_model(qwen3_dir, device="cuda")
    m.new_cache(64)
    m.prepare()
    k, e, hd = m.cfg.num_experts_per_tok, m.cfg.num_experts, m.cfg.hidden_size
    x, r = fresh((1, hd), torch.float16).cuda(), fresh((1, hd), torch.float16).cuda()
    pos = torch.tensor([5], device="cuda")
    a = m.decode_dense(0, x + r, pos, 64, m.decode_mask(pos, 64))
    out = RouteOut(torch.arange(e, dtype=torch.int32, device="cuda").flip(0).contiguous(),
                   torch.zeros(k, dtype=torch.int32, device="cuda"), torch.zeros(1, 2 * k, device="cuda"))
    b = m.decode_dense(0, x, pos, 64, m.decode_mask(pos, 64), residual=r.float(), route_out=out)
    for name, u, v in zip(("x", "h", "ids", "weights"), a, b):
        assert torch.equal(u, v), name
    assert torch.equal(out.slots.long(), e - 1 - b[2].reshape(-1))
    assert torch.equal(out.row, torch.cat([b[2].float(), b[3]], 1))

"""QPN launchers in CPU mode: torch references vs formats.dequant, and clean input validation."""
import pytest
import torch
import torch.nn.functional as F

from hybrid.checkpoint.formats import QType
from hybrid.checkpoint.qweight import QWeight
from hybrid.kernels import QPNExpertSlots, QPNWeight, qpn_linear, qpn_moe
from tests.test_qpn_layout import fp8, nvfp4

MAKE = {QType.NVFP4: nvfp4, QType.FP8: fp8}


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_linear_reference_matches_dequant_matmul(qtype, m):
    qw = MAKE[qtype](48, 128, seed=m)
    w = QPNWeight.from_qweight(qw, "cpu")
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).half()
    y = qpn_linear(x, w)
    assert y.dtype == torch.float16 and tuple(y.shape) == (m, 48)
    ref = x.double() @ qw.dequantize(torch.float64).t()
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    assert w.nbytes == qw.nbytes


def test_dense_weight_passes_through():
    qw = QWeight(QType.F16, (8, 64), torch.randn(8, 64).half())
    x = torch.randn(2, 64).half()
    torch.testing.assert_close(qpn_linear(x, QPNWeight.from_qweight(qw, "cpu")).float(),
                               (x.float() @ qw.data.float().t()), rtol=2e-3, atol=2e-3)


def slots_with(qtype, s=4, h=128, i=64):
    sl = QPNExpertSlots(s, h, i, qtype, "cpu")
    mats = []
    for j in range(s):
        e = (MAKE[qtype](i, h, seed=3 * j), MAKE[qtype](i, h, seed=3 * j + 1), MAKE[qtype](h, i, seed=3 * j + 2))
        sl.load(j, *e)
        mats.append(e)
    return sl, mats


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_moe_reference_matches_per_assignment_sum(qtype):
    sl, mats = slots_with(qtype)
    x = torch.randn(3, 128).half()
    ids = torch.tensor([0, 3, 1, 1, 2], dtype=torch.int32)
    tok = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)
    rw = torch.tensor([0.5, 0.25, 1.0, 0.3, 0.7])
    y = qpn_moe(x, sl, ids, tok, rw)
    ref = torch.zeros(3, 128, dtype=torch.float64)
    for a in range(5):
        g, u, d = (q.dequantize(torch.float64) for q in mats[ids[a]])
        xv = x[tok[a]].double()
        ref[tok[a]] += rw[a].double() * (d @ (F.silu(g @ xv) * (u @ xv)))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=5e-3, atol=5e-3 * ref.abs().max().item())


def test_slots_nbytes_per_slot():
    sl = QPNExpertSlots(2, 2048, 768, QType.NVFP4, "cpu")
    words = (2 * 768 * 2048 + 2048 * 768) // 2
    assert sl.nbytes_per_slot == words + words // 8 + 12


# ---------------------------------------------------------------------------- validation
@pytest.fixture
def w():
    return QPNWeight.from_qweight(nvfp4(32, 128), "cpu")


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.randn(2, 128), "dtype"),
    (lambda: torch.randn(2, 64).half(), "shape"),
    (lambda: torch.randn(128).half(), "shape"),
    (lambda: torch.randn(128, 2).half().t(), "contiguous"),
    (lambda: [[0.0] * 128], "torch.Tensor"),
])
def test_linear_rejects_bad_inputs(w, bad, match):
    with pytest.raises(ValueError, match=match):
        qpn_linear(bad(), w)


def test_linear_rejects_bad_out(w):
    with pytest.raises(ValueError, match="out"):
        qpn_linear(torch.randn(2, 128).half(), w, out=torch.empty(3, 32, dtype=torch.float16))


def test_from_qweight_rejects_odd_in_features():
    with pytest.raises(ValueError, match="multiple of 64"):
        QPNWeight.from_qweight(nvfp4(16, 96), "cpu")
    with pytest.raises(ValueError, match="multiple of 32"):
        QPNWeight.from_qweight(fp8(16, 48), "cpu")


def test_slots_reject_bad_config_and_experts():
    with pytest.raises(ValueError, match="num_slots"):
        QPNExpertSlots(0, 128, 64, QType.NVFP4, "cpu")
    with pytest.raises(ValueError, match="multiple of 64"):
        QPNExpertSlots(2, 128, 48, QType.NVFP4, "cpu")
    sl = QPNExpertSlots(2, 128, 64, QType.NVFP4, "cpu")
    with pytest.raises(ValueError, match="slot 2"):
        sl.load(2, nvfp4(64, 128), nvfp4(64, 128), nvfp4(128, 64))
    with pytest.raises(ValueError, match="down"):
        sl.load(0, nvfp4(64, 128), nvfp4(64, 128), nvfp4(64, 128))
    with pytest.raises(ValueError, match="gate"):
        sl.load(0, fp8(64, 128), nvfp4(64, 128), nvfp4(128, 64))


def test_moe_rejects_bad_routing_tensors():
    sl, _ = slots_with(QType.NVFP4, s=2)
    x = torch.randn(2, 128).half()
    ids = torch.tensor([0, 1], dtype=torch.int32)
    tok = torch.tensor([0, 1], dtype=torch.int32)
    rw = torch.ones(2)
    with pytest.raises(ValueError, match="slot_ids"):
        qpn_moe(x, sl, ids.long(), tok, rw)
    with pytest.raises(ValueError, match="token_idx"):
        qpn_moe(x, sl, ids, tok[:1], rw)
    with pytest.raises(ValueError, match="route_w"):
        qpn_moe(x, sl, ids, tok, rw.half())
    with pytest.raises(ValueError, match="x"):
        qpn_moe(x.float(), sl, ids, tok, rw)


def test_pack_host_shapes_match_slot_storage():
    sl = QPNExpertSlots(2, 128, 64, QType.NVFP4, "cpu")
    packed = sl.pack_host(nvfp4(64, 128), nvfp4(64, 128, seed=1), nvfp4(128, 64, seed=2))
    assert tuple(packed["w13"].shape) == (2 * 64 // 16, 128 // 64, 32, 4)
    assert tuple(packed["w2"].shape) == (128 // 16, 64 // 64, 32, 4)
    assert tuple(packed["s13"].shape) == (8, 2, 8, 8) and packed["gs"].shape == (3,)
    with pytest.raises(ValueError, match="CUDA"):
        sl.load_packed(0, packed)


def test_route_plan_reference_matches_route_kernel_contract():
    """ref_route_plan: ids outside [0, S) dropped, perm grouped by slot in assignment order, offsets the
    exclusive prefix of the counts, active ascending then -1."""
    from hybrid.kernels.moe_route import ref_route_plan

    offsets, perm, active = ref_route_plan(torch.tensor([3, -1, 0, 3, 7, 1, 0], dtype=torch.int32), 5)
    assert offsets.tolist() == [0, 2, 3, 3, 5, 5]
    assert perm.tolist() == [2, 6, 5, 0, 3]
    assert active.tolist() == [0, 1, 3, -1, -1]


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_moe_with_router_plan_matches_plain_moe(qtype):
    """The CPU path of the router's RoutePlan: fused.add_norm_router fills it (made), qpn_moe follows its
    groups into plan.y and clears made; the result is qpn_moe's without a plan. Absent experts (-1) dropped."""
    from hybrid.kernels import fused
    from hybrid.kernels.moe_route import RoutePlan

    sl, _ = slots_with(qtype)
    t, h, e, k = 2, 128, 6, 3
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, h, generator=g).half()
    router = torch.randn(e, h, generator=g)
    table = torch.tensor([2, -1, 0, 3, 1, -1], dtype=torch.int32)
    slots, row = torch.zeros(t * k, dtype=torch.int32), torch.zeros(t, 2 * k)
    plan = RoutePlan.new(t, k, 4, h, "cpu")
    plan.y.fill_(float("nan"))
    _, hn, ids, wt = fused.add_norm_router(x, torch.ones(h), 1e-6, router, k, True, None, table, slots, row, plan=plan)
    assert plan.made
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(k)
    keep = slots >= 0
    want = qpn_moe(hn.half(), sl, slots[keep], tok[keep], wt.reshape(-1)[keep])
    got = qpn_moe(hn.half(), sl, slots, tok, wt.reshape(-1), plan=plan)
    assert got is plan.y and not plan.made
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="plan.perm: expected shape"):
        fused.add_norm_router(x[:1], torch.ones(h), 1e-6, router, k, True, None, table, slots[:k], row[:1], plan=plan)
    with pytest.raises(ValueError, match="plan: needs slot_table"):
        fused.add_norm_router(x, torch.ones(h), 1e-6, router, k, True, plan=plan)


def test_carveout_switch(monkeypatch):
    """HYBRID_SMEM_CARVEOUT (the kernels' preferred shared-memory carveout): the default where unset, the value
    where valid, a one-line HybridError otherwise."""
    from hybrid.errors import HybridError
    from hybrid.kernels.driver import CARVEOUT_ENV, carveout

    monkeypatch.delenv(CARVEOUT_ENV, raising=False)
    assert carveout(100) == 100 and carveout(None) is None
    for v, want in (("0", 0), ("-1", -1), ("100", 100)):
        monkeypatch.setenv(CARVEOUT_ENV, v)
        assert carveout(None) == want
    for bad in ("101", "-2", "half"):
        monkeypatch.setenv(CARVEOUT_ENV, bad)
        with pytest.raises(HybridError, match=CARVEOUT_ENV):
            carveout(100)

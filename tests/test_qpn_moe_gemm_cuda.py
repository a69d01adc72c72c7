"""The MoE prefill grouped GEMMs (qpn.MOE_GEMM / $HYBRID_MOE_GEMM: "1" qpn{2,8}_moe_gemm_* (WMMA), "f"
qpn{2,8}_moe_gemmf_* on sm_80+) on a GPU: qpn_moe with each against qpn_moe without (the mt4 kernels)
and the CPU reference, on random uneven routings (an empty slot, a one-row slot, heavy slots), both BM,
the native build and (WMMA) compute_70 PTX through the driver JIT (the Volta code); and in a CUDA graph."""
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import qpn_moe
from hybrid.kernels import qpn
from hybrid.kernels.qpn import force_ptx
from hybrid.kernels.reference import ref_moe
from tests.test_qpn_cuda import make_slots, skip_without_ptx70

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=[("1", "native"), ("1", "ptx70"), ("f", "native")], ids=lambda p: "-".join(p))
def path(request):
    choice, backend = request.param
    dev = torch.device("cuda", torch.cuda.current_device())
    if backend == "ptx70":
        skip_without_ptx70()
    force_ptx(dev, 70 if backend == "ptx70" else None)
    yield choice, backend
    force_ptx(dev, None)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def run(x, slots, ids, tok, rw, choice):
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = choice
    try:
        return qpn_moe(x.cuda(), slots, ids.cuda(), tok.cuda(), rw.cuda()).cpu()
    finally:
        qpn.MOE_GEMM[0] = old


@pytest.mark.parametrize("qtype,h,i", [(QType.NVFP4, 256, 192), (QType.FP8, 288, 160)])
@pytest.mark.parametrize("t,bm", [(128, 32), (320, 64)])
def test_moe_gemm_matches_mt4_and_reference(path, qtype, h, i, t, bm, monkeypatch):
    choice, backend = path
    # both tile heights of each family, whatever MOE_GEMM_RULES picks on this card: BM 64 from 64 rows
    monkeypatch.setattr(qpn, "MOE_GEMM_RULES", {key: (1, 64) for key in qpn.MOE_GEMM_RULES})
    s, topk = 16, 4
    slots, experts = make_slots(qtype, s, h, i, t)
    g = torch.Generator().manual_seed(t + h)
    # skewed routing: slot 3 never chosen, slot 5 once, the low slots heavy
    p = torch.linspace(4.0, 0.2, s)
    p[3] = 0.0
    ids = torch.stack([torch.multinomial(p, topk, generator=g) for _ in range(t)]).flatten().int()
    ids[ids == 5] = 6
    ids[7] = 5
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=g)
    x = torch.randn(t, h, generator=g).half() * 4
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = choice
    sm = qpn._module(torch.device("cuda", torch.cuda.current_device())).sm
    plan = qpn.moe_gemm_plan(len(ids), s, 2 if qtype is QType.NVFP4 else 8, sm, h, i)
    qpn.MOE_GEMM[0] = old
    assert plan is not None and f"_{bm}x" in plan[0], f"the launcher picks {plan} for {len(ids) / s} rows per slot"
    y1 = run(x, slots, ids, tok, rw, choice)
    y0 = run(x, slots, ids, tok, rw, None)
    ref = ref_moe(x, experts, ids, tok, rw).double()
    assert torch.isfinite(y1).all()
    e1, e0 = rel_err(y1, ref), rel_err(y0, ref)
    assert e1 < 3e-3, f"{choice} {backend} {qtype.value} T={t}: grouped GEMM relative error {e1:.2e} (mt4: {e0:.2e})"
    assert rel_err(y1, y0.double()) < 3e-3


@pytest.mark.parametrize("choice", ["1", "f"])
def test_moe_gemm_in_cuda_graph(choice, monkeypatch):
    """The grouped GEMM path needs no host sync: it captures and replays in a CUDA graph."""
    s, h, i, t, topk = 8, 256, 128, 64, 4
    monkeypatch.setattr(qpn, "MOE_GEMM_RULES", {key: (1, 64) for key in qpn.MOE_GEMM_RULES})
    slots, experts = make_slots(QType.NVFP4, s, h, i, 0)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(s, generator=g)[:topk] for _ in range(t)]).flatten().int()
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=g)
    x = torch.randn(t, h, generator=g).half()
    xd, idd, tokd, rwd = x.cuda(), ids.cuda(), tok.cuda(), rw.cuda()
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = choice
    try:
        qpn_moe(xd, slots, idd, tokd, rwd)   # build + load the module outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = qpn_moe(xd, slots, idd, tokd, rwd)
        xd.copy_(x * 2)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        qpn.MOE_GEMM[0] = old
    ref = ref_moe(x * 2, experts, ids, tok, rw).double()
    assert rel_err(y.cpu(), ref) < 3e-3

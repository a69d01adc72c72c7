"""The MoE prefill grouped GEMM (qpn{2,8}_moe_gemm_*, on with qpn.MOE_GEMM / $HYBRID_MOE_GEMM=1) on a
GPU: qpn_moe with it against qpn_moe without it (the mt4 kernels) and the CPU reference, on random
uneven routings (empty slots, one-row slots, heavy slots), both tiles, the native build and compute_70
PTX through the driver JIT (the Volta code)."""
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNExpertSlots, qpn_moe
from hybrid.kernels import qpn
from hybrid.kernels.qpn import force_ptx
from hybrid.kernels.reference import ref_moe
from tests.test_qpn_layout import fp8, nvfp4

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAKE = {QType.NVFP4: nvfp4, QType.FP8: fp8}


@pytest.fixture(params=["native", "ptx70"])
def backend(request):
    dev = torch.device("cuda", torch.cuda.current_device())
    force_ptx(dev, 70 if request.param == "ptx70" else None)
    yield request.param
    force_ptx(dev, None)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def run(x, slots, ids, tok, rw, gemm: bool):
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = gemm
    try:
        return qpn_moe(x.cuda(), slots, ids.cuda(), tok.cuda(), rw.cuda()).cpu()
    finally:
        qpn.MOE_GEMM[0] = old


@pytest.mark.parametrize("qtype,h,i", [(QType.NVFP4, 256, 192), (QType.FP8, 288, 160)])
@pytest.mark.parametrize("t,tile", [(128, (32, 128)), (320, (64, 128))])
def test_moe_gemm_matches_mt4_and_reference(backend, qtype, h, i, t, tile):
    s, topk = 16, 4
    slots = QPNExpertSlots(s, h, i, qtype, "cuda")
    experts = []
    for j in range(s):
        e = (MAKE[qtype](i, h, seed=7 * j + t), MAKE[qtype](i, h, seed=7 * j + 1 + t),
             MAKE[qtype](h, i, seed=7 * j + 2 + t))
        slots.load(j, *e)
        experts.append(e)
    g = torch.Generator().manual_seed(t + h)
    # skewed routing: slot 3 never chosen, slot 5 at most once, the low slots heavy
    p = torch.linspace(4.0, 0.2, s)
    p[3] = 0.0
    ids = torch.stack([torch.multinomial(p, topk, generator=g) for _ in range(t)]).flatten().int()
    ids[ids == 5] = 6
    ids[7] = 5
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=g)
    x = torch.randn(t, h, generator=g).half() * 4
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = True
    on = qpn.moe_gemm_tile(len(ids), s)
    qpn.MOE_GEMM[0] = old
    assert on == tile, f"the launcher picks {on} for {len(ids) / s} rows per slot"
    y1 = run(x, slots, ids, tok, rw, True)
    y0 = run(x, slots, ids, tok, rw, False)
    ref = ref_moe(x, experts, ids, tok, rw).double()
    assert torch.isfinite(y1).all()
    e1, e0 = rel_err(y1, ref), rel_err(y0, ref)
    assert e1 < 3e-3, f"{backend} {qtype.value} T={t}: grouped GEMM relative error {e1:.2e} (mt4: {e0:.2e})"
    assert rel_err(y1, y0.double()) < 3e-3


def test_moe_gemm_in_cuda_graph():
    """The grouped GEMM path needs no host sync: it captures and replays in a CUDA graph."""
    s, h, i, t, topk = 8, 256, 128, 64, 4
    slots = QPNExpertSlots(s, h, i, QType.NVFP4, "cuda")
    experts = []
    for j in range(s):
        e = (nvfp4(i, h, seed=3 * j), nvfp4(i, h, seed=3 * j + 1), nvfp4(h, i, seed=3 * j + 2))
        slots.load(j, *e)
        experts.append(e)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(s, generator=g)[:topk] for _ in range(t)]).flatten().int()
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=g)
    x = torch.randn(t, h, generator=g).half()
    xd, idd, tokd, rwd = x.cuda(), ids.cuda(), tok.cuda(), rw.cuda()
    old = qpn.MOE_GEMM[0]
    qpn.MOE_GEMM[0] = True
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

"""QPN kernels on a GPU vs the CPU reference: fresh random inputs, outputs poisoned with NaN first,
every M shape class, the native build and compute_70 PTX through the driver JIT (the Volta code)."""
import pytest
import torch

from hybrid.checkpoint.formats import QType
from hybrid.kernels import QPNExpertSlots, QPNWeight, qpn_linear, qpn_moe
from hybrid.kernels import layout, qpn
from hybrid.kernels.qpn import force_ptx
from hybrid.kernels.reference import ref_moe
from tests.test_qpn_layout import fp8, nvfp4

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAKE = {QType.NVFP4: nvfp4, QType.FP8: fp8}
MS = [1, 2, 3, 4, 5, 6, 7, 8, 16, 64, 333]
SEED = [1000]


def fresh(shape, dtype=torch.float16):
    SEED[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED[0])).to(dtype)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def skip_without_ptx70() -> None:
    """Skip where neither NVRTC can target compute_70 nor a prebuilt PTX of qpn.cu is found (CUDA 13 alone)."""
    from hybrid.kernels import build

    try:
        build._image_for(70, True)
    except Exception as exc:  # noqa: BLE001 - NvrtcError or a missing file
        pytest.skip(f"compute_70 PTX unavailable ({type(exc).__name__}); on the dev machine run `hybrid-bench "
                    "cuda-kernels --compile-only --emit DIR` and set HYBRID_CACHE_DIR=DIR here")


@pytest.fixture(params=["native", "ptx70"])
def backend(request):
    dev = torch.device("cuda", torch.cuda.current_device())
    if request.param == "ptx70":
        skip_without_ptx70()
    force_ptx(dev, 70 if request.param == "ptx70" else None)
    yield request.param
    force_ptx(dev, None)


@pytest.fixture(params=[None, "", "_u4", "_as", "_as4", "_m1", "_m1x2", "_mp", "_mpx2", "_t2", "_t2u1", "_tbu2",
                        "_tb1u4", "_m1tbu4", "_m1tbu8", "_m1tb2u4", "_mp2tbu4", "_mp2tbu8", "_mp2tb2u4", "_mp4tbu4",
                        "_mp4tb2u4", "_m1seq"])
def variant(request):
    from hybrid.kernels import qpn

    qpn.LINEAR_VARIANT[0] = request.param
    yield request.param
    qpn.LINEAR_VARIANT[0] = None


@pytest.fixture(params=[None, ""])
def moe_variant(request):
    from hybrid.kernels import qpn

    qpn.MOE_VARIANT[0] = request.param
    yield request.param
    qpn.MOE_VARIANT[0] = None


@pytest.fixture(params=["atomic", "ordered"])
def moe_reduce(request, monkeypatch):
    """HYBRID_MOE_REDUCE: the M <= 8 down kernel's fp32 atomics, or its ordered sum (the _ord kernels)."""
    monkeypatch.setenv("HYBRID_MOE_REDUCE", request.param)
    return request.param


@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 200, 320), (QType.FP8, 200, 352),
                                       (QType.NVFP4, 1024, 4096), (QType.FP8, 48, 1024)])
def test_linear_matches_reference_all_m(backend, variant, qtype, n, k):
    qw = MAKE[qtype](n, k, seed=n + k)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    for m in MS:
        x = fresh((m, k))
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        y = qpn_linear(x.cuda(), w, out=out).cpu()
        ref = x.double() @ wref.t()
        assert not torch.isnan(y).any(), f"M={m}: unwritten or NaN outputs"
        err = rel_err(y, ref)
        assert err < 2e-3, f"{backend} {qtype.value} M={m}: relative error {err:.2e}"


def test_m1_seq_two_waves_of_tiles(monkeypatch):
    """qpn2_linear_m1_seq (sm_90+; the default there for lm_head, LINEAR_VARIANT "_m1seq" forces it): a first wave of
    warps streaming two tiles each, then one tile per warp, on lm_head's shape with its rows cut short of a tile;
    right against the reference, every row written, the same bits on the next launch, by default, and as the
    kernel it replaces (qpn2_linear_m1_tbu8, with HYBRID_QPN_SEQ=0: one warp per tile there too, the same sums)."""
    from hybrid.kernels import build

    dev = torch.device("cuda", torch.cuda.current_device())
    if build.module(dev).sm < 90:
        pytest.skip("qpn2_linear_m1_seq is sm_90+")
    n, k = 151936 - 5, 2048
    qw = nvfp4(n, k, seed=7)
    w = QPNWeight.from_qweight(qw, "cuda")
    x = fresh((1, k))
    qpn.LINEAR_VARIANT[0] = "_m1seq"
    try:
        outs = [qpn_linear(x.cuda(), w, out=torch.full((1, n), float("nan"), dtype=torch.float16, device="cuda"))
                for _ in range(2)]
    finally:
        qpn.LINEAR_VARIANT[0] = None
    y = outs[0].cpu()
    assert not torch.isnan(y).any(), "unwritten outputs"
    assert rel_err(y, x.double() @ qw.dequantize(torch.float64).t()) < 2e-3
    assert torch.equal(outs[1].cpu(), y)
    assert torch.equal(qpn_linear(x.cuda(), w).cpu(), y)
    monkeypatch.setenv("HYBRID_QPN_SEQ", "0")
    assert torch.equal(qpn_linear(x.cuda(), w).cpu(), y)


@pytest.fixture(params=[None, "mt", "wmma", "128x128", "64x128", "64x64", "32x64", "f128x128", "f64x256",
                        "f64x128"])
def prefill(request):
    from hybrid.kernels import qpn

    qpn.PREFILL_VARIANT[0] = request.param
    yield request.param
    qpn.PREFILL_VARIANT[0] = None


def _check_linear(w, wref, m, k, n, what, scale=1.0, tol=2e-3):
    x = fresh((m, k)) * scale
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    y = qpn_linear(x.cuda(), w, out=out).cpu()
    ref = x.double() @ wref.t()
    assert not torch.isnan(y).any(), f"{what} M={m}: unwritten or NaN outputs"
    assert torch.isfinite(y).all(), f"{what} M={m}: overflow"
    err = rel_err(y, ref)
    assert err < tol, f"{what} M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 200, 320), (QType.FP8, 200, 352),
                                       (QType.NVFP4, 1000, 2048), (QType.FP8, 136, 1056)])
def test_prefill_gemm_matches_reference(backend, prefill, qtype, n, k):
    """M > 16 (the tiled GEMM, each tile, and the old 8-row-tile path): odd M, N not a multiple
    of the tile, FP8 K = 32 mod 64."""
    qw = MAKE[qtype](n, k, seed=n + k)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    for m in (17, 31, 100, 129, 300):
        _check_linear(w, wref, m, k, n, f"{backend} {prefill} {qtype.value}")


@pytest.mark.parametrize("tb", ["_tbu2", "_tb1u4"])
@pytest.mark.parametrize("qtype,n,k", [(QType.NVFP4, 200, 320), (QType.FP8, 200, 352), (QType.NVFP4, 1000, 2048)])
def test_tb_tiles_of_x_match_reference(tb, qtype, n, k):
    """sm_90+: the bulk-ring kernels over passes of MT = 2 (M = 9..16) and 4 (M > 16 with PREFILL_VARIANT "mt")
    8-row tiles of x, rows past M re-read and never written, several passes."""
    from hybrid.kernels import build

    if build.module(torch.device("cuda", torch.cuda.current_device())).sm < 90:
        pytest.skip("bulk-copy rings are sm_90+")
    qw = MAKE[qtype](n, k, seed=n + k + 3)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    qpn.LINEAR_VARIANT[0], qpn.PREFILL_VARIANT[0] = tb, "mt"
    try:
        for m in (9, 13, 16, 17, 31, 100):
            _check_linear(w, wref, m, k, n, f"{tb} {qtype.value}")
    finally:
        qpn.LINEAR_VARIANT[0] = qpn.PREFILL_VARIANT[0] = None


@pytest.fixture(params=[None, 3, 16])
def split(request):
    from hybrid.kernels import qpn

    qpn.PREFILL_SPLIT[0] = request.param
    yield request.param
    qpn.PREFILL_SPLIT[0] = None


@pytest.mark.parametrize("qtype,n,k,tile", [(QType.NVFP4, 1000, 2048, None), (QType.FP8, 136, 1056, "32x64"),
                                            (QType.NVFP4, 200, 320, "128x128"), (QType.NVFP4, 90, 4096, "64x128"),
                                            (QType.FP8, 136, 1056, "f64x128"), (QType.NVFP4, 300, 320, "f128x128"),
                                            (QType.NVFP4, 90, 4096, "f64x256"), (QType.FP8, 1000, 2048, "wmma")])
def test_prefill_split_k_matches_reference(backend, split, qtype, n, k, tile):
    """Split-K (forced 3, 16 splits or picked): fp32 partials in a scratch, the last block of a
    tile sums them in split order; N % 8 != 0, FP8 K = 32 mod 64 (the last split ends half-way
    through a load set), more splits asked than k-steps. Deterministic: a second call is identical."""
    from hybrid.kernels import qpn

    qw = MAKE[qtype](n, k, seed=n + k + 7)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    qpn.PREFILL_VARIANT[0] = tile
    try:
        for m in (17, 64, 129):
            _check_linear(w, wref, m, k, n, f"{backend} {tile} split={split} {qtype.value}")
        x = fresh((40, k)).cuda()
        assert torch.equal(qpn_linear(x, w), qpn_linear(x, w)), "split-K sum not deterministic"
    finally:
        qpn.PREFILL_VARIANT[0] = None


@pytest.mark.parametrize("tile", ["f128x128", "f64x256", "f64x128"])
@pytest.mark.parametrize("qtype,k", [(QType.NVFP4, 320), (QType.FP8, 352), (QType.NVFP4, 1024), (QType.FP8, 1056)])
def test_prefill_gemmf_tile_edges(tile, qtype, k):
    """The sm_80+ register-fragment GEMM, each tile forced, native build: M on both sides of the
    64- and 128-row tiles, N below one 16-row weight tile, not a multiple of 8 or of the block's
    BN (a warp's tiles past N), FP8 K = 32 mod 64 (the last stage half empty), splits forced
    (none, 2, 7, more than k-steps); fresh inputs, poisoned outputs."""
    from hybrid.kernels import qpn

    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("gemmf needs sm_80+")
    qpn.PREFILL_VARIANT[0] = tile
    try:
        for n in (5, 136, 300):
            qw = MAKE[qtype](n, k, seed=n * 3 + k)
            w = QPNWeight.from_qweight(qw, "cuda")
            wref = qw.dequantize(torch.float64)
            for split in (None, 1, 2, 7, 64):
                qpn.PREFILL_SPLIT[0] = split
                for m in (17, 63, 64, 65, 127, 129, 200):
                    _check_linear(w, wref, m, k, n, f"{tile} split={split} {qtype.value} N={n}")
    finally:
        qpn.PREFILL_VARIANT[0] = None
        qpn.PREFILL_SPLIT[0] = None


def test_prefill_split_k_in_cuda_graph():
    """The split-K scratch and its zeroed counters are allocated and cleared inside a captured graph;
    each replay starts from zero counters."""
    qw = nvfp4(2048, 4096, seed=11)
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    x = torch.zeros(64, 4096, dtype=torch.float16, device="cuda")
    qpn_linear(x, w)  # build and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = qpn_linear(x, w)
    for _ in range(3):
        xs = fresh((64, 4096))
        x.copy_(xs.cuda())
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        err = rel_err(y.cpu(), xs.double() @ wref.t())
        assert err < 2e-3, f"graph replay: relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_prefill_gemm_largest_scales(backend, qtype):
    """Largest codes and block scales (NVFP4 6 x 448, FP8 448) with large activations: the group
    scale applied in the fp16 decode must neither overflow nor round."""
    from tests.test_qpn_gemm import max_scale_weight

    qw = max_scale_weight(qtype)
    n, k = qw.shape
    w = QPNWeight.from_qweight(qw, "cuda")
    wref = qw.dequantize(torch.float64)
    for m in (8, 16, 40, 129):
        _check_linear(w, wref, m, k, n, f"{backend} {qtype.value} max scales", scale=30.0)


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_prepack_on_gpu_equals_cpu(qtype):
    qw = MAKE[qtype](72, 256, seed=5)
    if qtype is QType.NVFP4:
        a, b = layout.pack_nvfp4(qw), layout.pack_nvfp4(qw.to("cuda"))
        assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
    else:
        assert torch.equal(layout.pack_fp8(qw), layout.pack_fp8(qw.to("cuda")).cpu())


def make_slots(qtype, s, h, i, seed, stride=7):
    """S random experts (gate, up, down; seeds stride * j + 0..2 + seed) loaded into CUDA slots 0..S-1."""
    slots = QPNExpertSlots(s, h, i, qtype, "cuda")
    experts = []
    for j in range(s):
        e = (MAKE[qtype](i, h, seed=stride * j + seed), MAKE[qtype](i, h, seed=stride * j + 1 + seed),
             MAKE[qtype](h, i, seed=stride * j + 2 + seed))
        slots.load(j, *e)
        experts.append(e)
    return slots, experts


def check_moe(backend, qtype, t, stride):
    """T tokens, each routed to 4 of 6 random experts, through qpn_moe against the reference (outputs written)."""
    s, h, i, topk = 6, 256, 128, 4
    slots, experts = make_slots(qtype, s, h, i, t, stride=stride)
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(s, generator=g)[:topk] for _ in range(t)]).flatten().int()
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=g)
    x = fresh((t, h)) * 4
    y = qpn_moe(x.cuda(), slots, ids.cuda(), tok.cuda(), rw.cuda()).cpu()
    assert not torch.isnan(y).any()
    err = rel_err(y, ref_moe(x, experts, ids, tok, rw).double())
    assert err < 3e-3, f"{backend} {qtype.value} T={t}: relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@pytest.mark.parametrize("t", [1, 3, 8, 20])
def test_moe_matches_reference(backend, moe_variant, moe_reduce, qtype, t):
    check_moe(backend, qtype, t, stride=10)


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@pytest.mark.parametrize("t", [9, 13, 16])
def test_moe_two_tiles_match_reference(backend, qtype, t, monkeypatch):
    """HYBRID_MOE_MT2=1: steps of 9..16 tokens through the two-8-row-tile ring kernels (sm_80+; below, the mt4
    ones): a slot with rows of the second tile, one with fewer than 8."""
    monkeypatch.setenv("HYBRID_MOE_MT2", "1")
    check_moe(backend, qtype, t, stride=11)


def test_moe_many_idle_slots(moe_variant, moe_reduce):
    """Decode shape: a few routed experts among many cached slots (the kernels launch one block
    row per active slot, listed by the route kernel)."""
    s, h, i, t, topk = 40, 256, 128, 2, 3
    slots = QPNExpertSlots(s, h, i, QType.NVFP4, "cuda")
    experts = []
    for j in range(s):
        e = (MAKE[QType.NVFP4](i, h, seed=3 * j), MAKE[QType.NVFP4](i, h, seed=3 * j + 1),
             MAKE[QType.NVFP4](h, i, seed=3 * j + 2))
        slots.load(j, *e)
        experts.append(e)
    ids = torch.tensor([39, 7, 22, 7, 0, 31], dtype=torch.int32)
    tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
    rw = torch.rand(t * topk, generator=torch.Generator().manual_seed(1))
    x = fresh((t, h)) * 4
    y = qpn_moe(x.cuda(), slots, ids.cuda(), tok.cuda(), rw.cuda()).cpu()
    err = rel_err(y, ref_moe(x, experts, ids, tok, rw).double())
    assert err < 3e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_moe_ordered_sum_repeats_bit_for_bit(backend, moe_variant, qtype, monkeypatch):
    """HYBRID_MOE_REDUCE=ordered: 1 and 5 tokens (a miss among them), launched 30 times and replayed from a CUDA
    graph 30 times: every output the same bits as the first launch's (the atomic form may differ in the last bit
    between launches), within the reference's tolerance."""
    monkeypatch.setenv("HYBRID_MOE_REDUCE", "ordered")
    s, h, i, topk = 8, 512, 256, 4
    slots, experts = make_slots(qtype, s, h, i, 3, stride=10)
    for t in (1, 5):
        g = torch.Generator().manual_seed(t)
        ids = torch.stack([torch.randperm(s, generator=g)[:topk] for _ in range(t)]).flatten().int()
        ids[1] = -1                                                   # a miss: no slot, not summed here
        tok = torch.arange(t, dtype=torch.int32).repeat_interleave(topk)
        rw = torch.rand(t * topk, generator=g)
        x = fresh((t, h))        # not x 4: FP8 gate*up at H = 512 would pass fp16's 65504 in h now and then
        args = (x.cuda(), slots, ids.cuda(), tok.cuda(), rw.cuda())
        first = qpn_moe(*args).clone()
        keep = ids >= 0
        ref = ref_moe(x, experts, ids[keep], tok[keep], rw[keep]).double()
        assert rel_err(first.cpu(), ref) < 3e-3
        for _ in range(30):
            assert torch.equal(qpn_moe(*args), first)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            qpn_moe(*args)                                           # warm-up on the capture stream
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = qpn_moe(*args)
        for _ in range(30):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, first)
    works = [v for d, v in qpn._MOE_WORK.items() if d.type == "cuda"]
    assert works and not works[0][1].any(), "the ordered kernels ran and left their counters zero"


def test_launcher_rejects_device_and_alignment_errors():
    w = QPNWeight.from_qweight(nvfp4(32, 128), "cuda")
    with pytest.raises(ValueError, match="weights are on"):
        qpn_linear(torch.randn(2, 128).half(), w)
    flat = torch.empty(2 * 128 + 1, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="aligned"):
        qpn_linear(flat[1:].view(2, 128), w)
    with pytest.raises(ValueError, match="multiple of 64"):
        QPNWeight.from_qweight(nvfp4(32, 96), "cuda")


def test_m_zero_returns_empty():
    w = QPNWeight.from_qweight(fp8(32, 64), "cuda")
    assert qpn_linear(torch.empty(0, 64, dtype=torch.float16, device="cuda"), w).shape == (0, 32)


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
def test_load_packed_equals_load(qtype):
    a = QPNExpertSlots(2, 256, 128, qtype, "cuda")
    b = QPNExpertSlots(2, 256, 128, qtype, "cuda")
    e = (MAKE[qtype](128, 256, seed=1), MAKE[qtype](128, 256, seed=2), MAKE[qtype](256, 128, seed=3))
    a.load(1, *e)
    b.load_packed(1, b.pack_host(*e), stream=torch.cuda.Stream())
    torch.cuda.synchronize()
    for name in ("w13", "w2", "s13", "s2", "gs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("qtype", [QType.NVFP4, QType.FP8])
@pytest.mark.parametrize("graph", [False, True])
def test_pdl_chain_equals_plain_launches(monkeypatch, qtype, graph):
    """Programmatic dependent launches (HYBRID_PDL=1, sm_90+): a chain of linear layers at M = 1 and 8,
    each reading the last one's output from two buffers used in turn (a kernel overwrites what the one
    before the last read), then a MoE layer on it, eager and replayed from a CUDA graph, equals the same
    chain launched plainly (the linear layers bit for bit, the MoE layer up to its atomic adds' order)."""
    from hybrid.kernels import qpn

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch is sm_90+")
    n = 1024
    ws = [QPNWeight.from_qweight(MAKE[qtype](n, n, seed=70 + j), "cuda") for j in range(5)]
    for w in ws:
        w.gscale /= 32.0   # outputs of the same size as the inputs along the chain (no fp16 overflow)
    slots, _ = make_slots(qtype, 6, n, 256, 8, stride=10)
    g = torch.Generator().manual_seed(5)

    def run(m):
        bufs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(2)]
        x = (fresh((m, n)) * 0.5).cuda()
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(m)]).flatten().int().cuda()
        tok = torch.arange(m, dtype=torch.int32).repeat_interleave(4).cuda()
        rw = torch.rand(m * 4, generator=g).cuda()

        def chain():
            y = x
            for j, w in enumerate(ws):
                y = qpn_linear(y, w, out=bufs[j % 2])
            return y.clone(), qpn_moe(y, slots, ids, tok, rw)

        outs = {}
        for mode in ("0", "1"):
            monkeypatch.setenv("HYBRID_PDL", mode)
            assert qpn.pdl(90) == (mode == "1")
            if graph:
                chain()                                   # warm-up: builds and loads the kernels
                torch.cuda.synchronize()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    res = chain()
                gr.replay()
                torch.cuda.synchronize()
                outs[mode] = [t.cpu() for t in res]
            else:
                outs[mode] = [t.cpu() for t in chain()]
        (lin0, moe0), (lin1, moe1) = outs["0"], outs["1"]
        assert torch.isfinite(lin0.float()).all() and torch.isfinite(moe0).all()
        assert torch.equal(lin0, lin1), f"M={m} graph={graph}: PDL changed the linear chain's results"
        # the MoE down kernel adds the experts into y with atomics: equal up to their order
        assert torch.allclose(moe0, moe1, rtol=1e-5, atol=1e-5 * moe0.abs().max().item()), \
            f"M={m} graph={graph}: PDL changed the MoE layer's results"

    for m in (1, 8):
        run(m)

"""qpn2_linear_m1_as_norm on a GPU: the residual add + RMSNorm made inside the GEMV's blocks gives the bits of
fused.add_rms_norm followed by qpn_linear (x2 and y), for every delta kind, odd N, K up to NORM_MAX_K; past it,
or from compute_70 PTX, the launcher falls back to those two calls. In the model: decode_dense with the
"prenorm" part on and off."""
import pytest
import torch

from hybrid.kernels import QPNWeight, fused, qpn_linear
from hybrid.kernels import qpn
from hybrid.kernels.qpn import force_ptx, norm_linear_fits, qpn_linear_norm
from tests.test_qpn_cuda import backend, fresh, skip_without_ptx70  # noqa: F401 - the fixture
from tests.test_qpn_layout import nvfp4

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _two_launches(x, w, nw, eps, delta):
    x2, h, _ = fused.add_rms_norm(x, nw, eps, delta=delta)
    return x2, qpn_linear(h, w)


@pytest.mark.parametrize("n,k", [(48, 64), (200, 320), (5120, 2048), (1000, 4096), (16, 4160)])
@pytest.mark.parametrize("dk", [None, torch.float16, torch.float32])
def test_norm_linear_equals_two_launches(backend, n, k, dk):  # noqa: F811 - pytest's fixture
    w = QPNWeight.from_qweight(nvfp4(n, k, seed=n + k), "cuda")
    x = (4 * fresh((1, k))).cuda()
    nw = (1 + 0.1 * fresh((k,), torch.float32)).cuda()
    delta = None if dk is None else (3 * fresh((1, k), torch.float32)).to("cuda", dk)
    fits = norm_linear_fits(x, w)
    assert fits == (backend == "native" and k <= qpn.NORM_MAX_K)
    x2, y = qpn_linear_norm(x, w, nw, 1e-6, delta)
    want_x2, want_y = _two_launches(x, w, nw, 1e-6, delta)
    assert not torch.isnan(y).any()
    assert torch.equal(x2, want_x2), "x + delta differs"
    assert torch.equal(y, want_y), f"y differs: max {(y.float() - want_y.float()).abs().max().item():.3e}"
    if delta is None:
        assert x2 is x


def test_norm_linear_in_a_graph_and_poisoned():
    """Captured and replayed with new inputs: every output element written, the same bits as eager."""
    k, n = 2048, 640
    w = QPNWeight.from_qweight(nvfp4(n, k, seed=7), "cuda")
    x, delta = fresh((1, k)).cuda(), fresh((1, k), torch.float32).cuda()
    nw = fresh((k,), torch.float32).cuda()
    qpn_linear_norm(x, w, nw, 1e-6, delta)                       # build, warm
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            x2, y = qpn_linear_norm(x, w, nw, 1e-6, delta)
    for seed in range(3):
        x.copy_(fresh((1, k)))
        delta.copy_(fresh((1, k), torch.float32))
        x2.fill_(float("nan")), y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want_x2, want_y = _two_launches(x, w, nw, 1e-6, delta)
        assert torch.equal(x2, want_x2) and torch.equal(y, want_y), f"replay {seed}"


def test_norm_linear_rejects_bad_inputs():
    w = QPNWeight.from_qweight(nvfp4(32, 128), "cuda")
    nw = torch.ones(128, device="cuda")
    with pytest.raises(ValueError, match="weight: expected shape"):
        qpn_linear_norm(torch.zeros(1, 128, dtype=torch.float16, device="cuda"), w, torch.ones(64, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        qpn_linear_norm(torch.zeros(1, 128, dtype=torch.float16, device="cuda"), w, nw, 1e-6,
                        torch.zeros(1, 128, dtype=torch.int32, device="cuda"))


@pytest.fixture(scope="module")
def nvfp4_model(tmp_path_factory):
    from hybrid.testing import write_random_model
    from tests.quant_layouts import to_nvfp4

    root = tmp_path_factory.mktemp("prenorm")
    bf16 = write_random_model(root / "bf16", "qwen3_moe", seed=9, hidden_size=256, num_hidden_layers=2)
    return to_nvfp4(bf16, root / "nvfp4", "modelopt")


@pytest.mark.parametrize("rk", [None, torch.float16, torch.float32])
def test_decode_dense_prenorm_on_and_off(nvfp4_model, monkeypatch, rk):
    """decode_dense's outputs with the add + norm in the q/k/v GEMV ("prenorm") are those of the separate norm
    launch, bit for bit, and the K/V rows it writes are the same."""
    from hybrid.model.loader import load_model

    hd = 256
    x0 = fresh((1, hd))
    r0 = None if rk is None else fresh((1, hd), torch.float32).to(rk)
    outs = []
    for parts in ("norm,router,attn,plan,wide", "norm,router,attn,plan,wide,prenorm"):
        monkeypatch.setenv("HYBRID_FUSED_NEW", parts)
        m = load_model(nvfp4_model, device="cuda")
        m.new_cache(64)
        m.prepare()
        assert m.cfg.hidden_size == hd
        x, r = x0.cuda(), None if r0 is None else r0.cuda()
        pos = torch.tensor([5], device="cuda")
        layer = m.layers[1]
        used = layer.attn.prenorm_ok(x, r, layer.input_norm, m.cache, 1)
        assert used == ("prenorm" in parts)
        got = m.decode_dense(1, x, pos, 64, m.decode_mask(pos, 64), residual=r)
        outs.append([t.clone() for t in got] + [m.cache.k_store[1][5].clone(), m.cache.v_store[1][5].clone()])
    for name, a, b in zip(("x", "h", "ids", "weights", "k row", "v row"), *outs):
        assert torch.equal(a, b), name

"""Prefill attention's GQA on a GPU (hybrid.model.layers.gqa_attention): the stride-0 expanded-keys path that
GPUs without flash attention take equals enable_gqa, and it runs on the memory-efficient kernel alone (the
backends a Volta card has, minus the math fallback), where enable_gqa finds no kernel."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybrid.model.layers import prefill_attention

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]


def _attend(q, ks, vs, t, p):
    return prefill_attention(q, ks[: p + t], vs[: p + t], p)


@pytest.mark.parametrize("t,p", [(96, 0), (33, 100)])
def test_expand_runs_on_the_efficient_kernel_and_equals_native(t, p, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(t + p)
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.float16, generator=g)
    ks, vs = (torch.randn(p + t, 4, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    monkeypatch.setenv("HYBRID_SDPA_GQA", "native")
    want = _attend(q, ks, vs, t, p)
    monkeypatch.setenv("HYBRID_SDPA_GQA", "expand")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = _attend(q, ks, vs, t, p)
        monkeypatch.setenv("HYBRID_SDPA_GQA", "native")
        with pytest.raises(RuntimeError):
            _attend(q, ks, vs, t, p)                      # enable_gqa: no memory-efficient kernel
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

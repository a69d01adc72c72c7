"""Expert-cache promotions and the warm start's slot fill from the pinned CPU store (HYBRID_PROMOTE_SOURCE=store,
the default) on a GPU: on the tiny model (NVFP4) with a small cache warm-started from a skewed expert
profile (slots in several layers, none of them full), the same greedy ids, promotions and slot contents as
both read from the checkpoint."""
import numpy as np
import pytest
import torch

from hybrid.generate import generate
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.store_stage import PROMOTE_ENV
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.testing import write_expert_profile
from tests.test_prefill_stream_cuda import _ids, _tok, nvfp4  # noqa: F401 - the tiny model in NVFP4 (fixture)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]


@pytest.fixture(scope="module")
def skewed(nvfp4, tmp_path_factory):  # noqa: F811 - fixture
    """A seeded random expert profile: the warm start's 32 slots land in several layers."""
    from hybrid.model.config import ModelConfig

    cfg = ModelConfig.from_folder(nvfp4)
    rng = np.random.default_rng(7)
    tokens, k = 256, cfg.num_experts_per_tok
    counts = np.stack([rng.multinomial(tokens * k, rng.dirichlet(np.full(cfg.num_experts, 0.3)))
                       for _ in range(cfg.num_hidden_layers)])
    return write_expert_profile(nvfp4, counts, tokens, tmp_path_factory.mktemp("promo_prof") / "skewed.experts.json")


def _session(path, ids, source, monkeypatch, profile):
    monkeypatch.setenv(PROMOTE_ENV, source)
    s = open_session(path, RuntimeOptions(device="cuda", cache_slots=(32,), prefill_offload_min=0,
                                          expert_profile=profile))
    try:
        warm = [len(c.residents(l)) for c in s.caches for l in c.layers]   # filled at load
        out = [generate(s.model, _tok(path), ids, 12, Sampler(SamplerConfig())).generated_ids for _ in range(2)]
        torch.cuda.synchronize()
        proms = [c.stats().promotions.tolist() for c in s.caches]
        slots = {(l, n): getattr(st.slots, n).clone() for l, st in s.cards[0].slots._store.items()
                 for n in ("w13", "w2", "s13", "s2", "gs")}
        used = s.model.experts._promote_target(s.cards[0], next(iter(s.cards[0].slots._store))) is not None
    finally:
        s.close()
    return out, proms, slots, used, warm


def test_promotions_from_store_equal_checkpoint(nvfp4, skewed, monkeypatch):  # noqa: F811 - fixture
    ids = _ids(nvfp4, 64)
    a, pa, sa, used_a, warm = _session(nvfp4, ids, "checkpoint", monkeypatch, skewed)
    b, pb, sb, used_b, _ = _session(nvfp4, ids, "store", monkeypatch, skewed)
    assert not used_a and used_b
    assert sum(n > 0 for n in warm) >= 2                                # slots filled at load in several layers
    assert sum(sum(map(sum, p)) for p in pb) > 0 and pa == pb             # [cache][layer][expert]
    assert a == b
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k

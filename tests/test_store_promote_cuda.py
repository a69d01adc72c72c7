"""Expert-cache promotions and the warm start's slot fill from the pinned CPU store (HYBRID_PROMOTE_SOURCE=store,
the default) on a GPU: on the tiny
model (NVFP4) with a small cache, the same greedy ids, promotions and slot contents as promotions read from
the checkpoint."""
import pytest
import torch

from hybrid.generate import generate
from hybrid.model import resolve_model_path
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.store_stage import PROMOTE_ENV
from hybrid.sampler import Sampler, SamplerConfig
from tests.quant_layouts import to_nvfp4
from tests.test_prefill_stream_cuda import _ids, _tok

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    return to_nvfp4(resolve_model_path("tiny"), tmp_path_factory.mktemp("promo") / "nvfp4")


def _session(path, ids, source, monkeypatch):
    monkeypatch.setenv(PROMOTE_ENV, source)
    s = open_session(path, RuntimeOptions(device="cuda", cache_slots=(32,), prefill_offload_min=0))
    try:
        out = [generate(s.model, _tok(path), ids, 12, Sampler(SamplerConfig())).generated_ids for _ in range(2)]
        torch.cuda.synchronize()
        proms = [c.stats().promotions.tolist() for c in s.caches]
        slots = {(l, n): getattr(st.slots, n).clone() for l, st in s.cards[0].slots._store.items()
                 for n in ("w13", "w2", "s13", "s2", "gs")}
        used = s.model.experts._promote_target(s.cards[0], next(iter(s.cards[0].slots._store))) is not None
    finally:
        s.close()
    return out, proms, slots, used


def test_promotions_from_store_equal_checkpoint(nvfp4, monkeypatch):
    ids = _ids(nvfp4, 64)
    a, pa, sa, used_a = _session(nvfp4, ids, "checkpoint", monkeypatch)
    b, pb, sb, used_b = _session(nvfp4, ids, "store", monkeypatch)
    assert not used_a and used_b
    assert sum(sum(map(sum, p)) for p in pb) > 0 and pa == pb             # [cache][layer][expert]
    assert a == b
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k

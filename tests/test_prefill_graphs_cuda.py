"""Prefill graphs (hybrid.runtime.prefill_graphs) on a GPU: the tiny model in NVFP4, every expert resident.
Short prompts' prefill replays captured graphs (a bucket's first prompt runs eagerly, the second captures
it, later ones replay; one bucket past the request's max_tokens) and gives the eager prefill's logits
(2e-2: the kernels see the padded rows) and greedy ids; with a layer that can miss, the prefill stays eager."""
import numpy as np
import pytest
import torch

from hybrid.generate import generate
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.testing import write_expert_profile
from tests.test_prefill_stream_cuda import _ids, _tok, nvfp4  # noqa: F401 - the tiny model in NVFP4 (fixture)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda]


@pytest.fixture(scope="module")
def uniform(nvfp4, tmp_path_factory):  # noqa: F811 - fixture
    """An expert profile using every expert alike: the warm start fills every slot (all resident)."""
    cfg = ModelConfig.from_folder(nvfp4)
    tokens = cfg.num_experts * 4
    counts = np.full((cfg.num_hidden_layers, cfg.num_experts), tokens * cfg.num_experts_per_tok // cfg.num_experts,
                     dtype=np.int64)
    return write_expert_profile(nvfp4, counts, tokens, tmp_path_factory.mktemp("pgraph_prof") / "uniform.experts.json")


def _gen(path, prompts, env, monkeypatch, profile, slots=None, chunk=0):
    monkeypatch.setenv("HYBRID_PREFILL_GRAPHS", env)
    monkeypatch.setenv("HYBRID_PREFILL_GRAPH_CHUNKS", "1" if chunk else "0")
    cfg = ModelConfig.from_folder(path)
    slots = cfg.num_hidden_layers * cfg.num_experts if slots is None else slots
    s = open_session(path, RuntimeOptions(device="cuda", cache_slots=(slots,), expert_profile=profile))
    try:
        out, first = [], []
        forward = s.model.forward

        def spy(x, start, last_only=False):
            y = forward(x, start, last_only)
            if start == 0:
                first.append(y[-1].float().cpu())
            return y

        s.model.forward = spy
        for ids in prompts:
            s.model.prompt_tokens = len(ids)
            out.append(generate(s.model, _tok(path), ids, 8, Sampler(SamplerConfig()),
                                prefill_chunk=chunk).generated_ids)
        pg = s.model.prefill_graphs
        resident = all(s.model.experts.device_only(i) for i in range(cfg.num_hidden_layers))
        assert resident == (slots >= cfg.num_hidden_layers * cfg.num_experts)
        return out, first, (pg.captures, pg.steps, pg.error)
    finally:
        s.close()


def _graphs_vs_eager(path, prompts, monkeypatch, profile, chunk=0):
    """The prompts' greedy ids with prefill graphs on equal those with them off -> (captures, steps, error)."""
    want, _, _ = _gen(path, prompts, "0", monkeypatch, profile, chunk=chunk)
    got, _, stats = _gen(path, prompts, "1", monkeypatch, profile, chunk=chunk)
    assert got == want
    return stats


def test_prefill_graphs_match_eager(nvfp4, uniform, monkeypatch):  # noqa: F811 - fixture
    ids = _ids(nvfp4, 40)
    prompts = [ids[:12], ids[:14], ids[:40], ids[:16], ids[:40]]   # buckets 16, 16, 64, 16, 64
    want, want_first, (c0, s0, _) = _gen(nvfp4, prompts, "0", monkeypatch, uniform)
    got, got_first, (captures, steps, error) = _gen(nvfp4, prompts, "1", monkeypatch, uniform)
    assert (c0, s0) == (0, 0)
    # a bucket's first prompt runs eagerly (PREFILL_GRAPH_AFTER), the next ones replay its one graph
    assert error is None and steps == 3 and captures == 2
    for a, b in zip(got_first, want_first):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert int(a.argmax()) == int(b.argmax())
    assert got == want


def test_a_smaller_bucket_captured_after_a_longer_prompt(nvfp4, uniform, monkeypatch):  # noqa: F811 - fixture
    """Bucket 64 captured and replayed (the head's row 39), then bucket 16 captured: its eager warm-up must
    select row 11 of its 16 rows, not the 39 the last replay left (a device-side assert ended the process)."""
    ids = _ids(nvfp4, 40)
    prompts = [ids, ids, ids, ids[:12], ids[:12], ids[:12]]
    assert _graphs_vs_eager(nvfp4, prompts, monkeypatch, uniform) == (2, 4, None)   # captures, steps, error


def test_a_prompt_past_the_largest_bucket_runs_in_graph_steps(nvfp4, uniform, monkeypatch):  # noqa: F811
    """A 600-token prompt under a 4096-token chunk runs as 512 + 88 (bucket 128) graph steps
    (PrefillGraphs.split_step): eager at the first prompt, captured at the second, replayed at the third;
    the same greedy ids as one eager step."""
    ids = _ids(nvfp4, 600)
    prompts = [ids, ids[:599] + ids[:1], ids]
    assert _graphs_vs_eager(nvfp4, prompts, monkeypatch, uniform, chunk=4096) == (2, 4, None)


def test_prefill_stays_eager_when_a_layer_can_miss(nvfp4, uniform, monkeypatch):  # noqa: F811 - fixture
    _, _, (captures, steps, error) = _gen(nvfp4, [_ids(nvfp4, 12)], "1", monkeypatch, uniform, slots=8)
    assert (captures, steps, error) == (0, 0, None)


def test_later_chunks_through_graphs(nvfp4, uniform, monkeypatch):  # noqa: F811 - fixture
    """HYBRID_PREFILL_GRAPH_CHUNKS=1: a 40-token prompt in chunks of 16 (starts 0, 16, 32; the last padded to
    16 rows): the first prompt runs eagerly, the second captures one graph per (bucket, start), the third
    replays them; the same greedy ids as the eager chunked prefill."""
    ids = _ids(nvfp4, 40)
    prompts = [ids, ids[:39] + ids[:1], ids]
    assert _graphs_vs_eager(nvfp4, prompts, monkeypatch, uniform, chunk=16) == (3, 6, None)


def test_later_chunks_keep_free_memory(nvfp4, uniform, monkeypatch):  # noqa: F811 - fixture
    """No later-chunk graph is captured while a card has less than PREFILL_CHUNK_GRAPH_FREE_MIB free: the
    prompt's first chunk still replays its graph, the later ones run eagerly, the same greedy ids."""
    from hybrid.runtime import prefill_graphs

    ids = _ids(nvfp4, 40)
    prompts = [ids, ids[:39] + ids[:1], ids]
    want, _, _ = _gen(nvfp4, prompts, "0", monkeypatch, uniform, chunk=16)
    free = torch.cuda.mem_get_info()[0] // 2**20
    monkeypatch.setattr(prefill_graphs, "PREFILL_CHUNK_GRAPH_FREE_MIB", free + 1024)
    got, _, (captures, steps, error) = _gen(nvfp4, prompts, "1", monkeypatch, uniform, chunk=16)
    assert error is None and captures == 1 and steps == 2
    assert got == want


def test_captures_share_one_cublas_workspace(monkeypatch):
    """Graphs captured on the kept stream per device (the default) reuse its cuBLAS workspace; with a new
    capture stream per graph (HYBRID_GRAPH_STREAM=0) each capture allocates another in its pool."""
    from hybrid.runtime.graphs import capture_runner

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(64, 64, device=dev, dtype=torch.float16)

    def grow(n: int) -> int:
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()
        r0 = torch.cuda.memory_reserved(dev)
        runners = [capture_runner(dev, lambda: a @ a, a, a, pool) for _ in range(n)]
        grown = torch.cuda.memory_reserved(dev) - r0
        for r in runners:
            r.run()
            assert torch.equal(r.out, a @ a)
        return grown

    monkeypatch.setenv("HYBRID_GRAPH_STREAM", "1")
    grow(1)                                  # the kept stream's first warm-up places its workspace
    kept = grow(4)
    monkeypatch.setenv("HYBRID_GRAPH_STREAM", "0")
    new = grow(4)
    assert new - kept >= 4 * 2**20, (kept, new)

"""Prefill graphs (hybrid.runtime.prefill_graphs) checked on the CPU: the graph bodies run eagerly
(capture=False) on a prompt padded to its bucket must give the eager prefill's last-token logits, the
same greedy continuation (the padded KV rows are never attended), and the same cache counters (only
the prompt's rows are settled); a layer that can miss keeps the eager path."""
import numpy as np
import pytest
import torch

from hybrid.runtime import RuntimeOptions, open_session
from hybrid.model.layers import KVCache
from hybrid.runtime.prefill_graphs import PREFILL_GRAPH_MAX, PrefillGraphs, bucket_for, rows_for
from hybrid.testing import greedy_logits, tokenizer_for
from tests.test_decode_graphs import EXPERTS, LAYERS, models, warm  # noqa: F401 - fixtures

PROMPT = "def fibonacci(n):\n    if n < 2:"            # 11+ tokens: padded to the 16-row bucket
PLACES = {"all_resident": ((LAYERS * EXPERTS,), {}, True),
          "split_resident": ((2 * EXPERTS, 2 * EXPERTS), dict(gpus=(0, 0), layer_split=(2,)), True),
          "mixed": ((2 * EXPERTS, 20), dict(gpus=(0, 0), layer_split=(2,)), False)}


def test_bucket_for():
    assert [bucket_for(t) for t in (1, 2, 16, 17, 33, 200, 256)] == [16, 16, 16, 32, 64, 256, 256]
    assert bucket_for(PREFILL_GRAPH_MAX + 1) is None
    assert bucket_for(5, lo=4, hi=8) == 8 and bucket_for(9, lo=4, hi=8) is None


def _run(model_dir, warm, slots, extra, graphed: bool, marks: bool = False):
    """marks: a prefill's resident layers settle as marked expert sets (the default without a trace); else
    as ids, which the spy below records per layer."""
    ids = tokenizer_for(model_dir).encode(PROMPT)
    s = open_session(model_dir, RuntimeOptions(cache_slots=slots, expert_profile=warm, pcie_frac=0.0, **extra))
    try:
        pg = None
        if graphed:
            pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True,
                                                        after=0)
        s.model.prompt_tokens = len(ids)
        first = {}
        forward = s.model.forward

        def spy(x, start, last_only=False):              # the prefill's own logits
            out = forward(x, start, last_only)
            first.setdefault("logits", out[-1].clone())
            first.setdefault("length", s.model.cache.length)
            return out

        s.model.forward = spy
        ex, routed = s.model.experts, []
        account = ex._account
        if not marks:
            ex._marks_only = lambda pairs: False

        def spy_account(layer, cuda, ids_h, w_h, *a, **kw):   # every layer's routed ids, as counted
            if ids_h is not None:
                routed.append((layer, ids_h.copy(), np.asarray(w_h).copy()))
            return account(layer, cuda, ids_h, w_h, *a, **kw)

        ex._account = spy_account
        got_ids, rows = greedy_logits(s.model, ids, 6)
        counters = ([c.hits.copy() for c in s.caches], [c.misses.copy() for c in s.caches])
        prompt_routing = sorted((r for r in routed if len(r[1]) > 1), key=lambda r: r[0])
        return len(ids), got_ids, first, rows, (counters, prompt_routing), pg.steps if pg else 0
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("place", sorted(PLACES))
def test_prefill_graph_body_matches_eager(models, warm, kind, place):  # noqa: F811 - fixtures
    slots, extra, usable = PLACES[place]
    n, ids0, first0, rows0, cnt0, _ = _run(models[kind], warm, slots, extra, graphed=False)
    n1, ids1, first1, rows1, cnt1, steps = _run(models[kind], warm, slots, extra, graphed=True)
    assert n == n1 and 2 <= n < bucket_for(n)              # the prompt was padded
    assert steps == (1 if usable else 0)
    assert first1["length"] == first0["length"] == n       # the padded rows are not committed
    tol = 1e-4 if kind == "bf16" else 1e-2
    torch.testing.assert_close(first1["logits"], first0["logits"], atol=tol, rtol=tol)
    assert ids1 == ids0
    torch.testing.assert_close(rows1, rows0, atol=tol, rtol=tol)
    (c0, r0), (c1, r1) = cnt0, cnt1
    for a, b in zip(c0[0] + c0[1], c1[0] + c1[1]):
        assert np.array_equal(a, b)
    assert [r[0] for r in r1] == list(range(LAYERS))       # only the prompt's rows were counted:
    for (_, i0, w0), (_, i1, w1) in zip(r0, r1):           # [T, k] per layer, the eager ids
        assert i1.shape == i0.shape == (n, i0.shape[1]) and np.array_equal(i0, i1)
        np.testing.assert_allclose(w1, w0, atol=1e-4, rtol=1e-3)   # M = B vs T rows: last bits


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("place", sorted(PLACES))
def test_prefill_settles_as_marks(models, warm, graphed, place):  # noqa: F811 - fixtures
    """A prefill's resident layers settle from their marked expert sets (no trace: the default) to the same
    hit and miss counters, greedy ids and logits as from their ids, on one card, split over two, and beside a
    card whose layers can miss; only decode steps' and can-miss layers' ids are seen then."""
    slots, extra, _ = PLACES[place]
    n, ids0, _, rows0, (cnt0, routed0), _ = _run(models["nvfp4"], warm, slots, extra, graphed, marks=False)
    n1, ids1, _, rows1, (cnt1, routed1), _ = _run(models["nvfp4"], warm, slots, extra, graphed, marks=True)
    assert ids1 == ids0 and routed0
    if place != "mixed":
        assert not routed1                                 # the prompt's ids were not copied as ids
    else:                                                  # only the can-miss card's layers were
        assert 0 < len(routed1) < len(routed0)
    torch.testing.assert_close(rows1, rows0)
    for a, b in zip(cnt0[0] + cnt0[1], cnt1[0] + cnt1[1]):
        assert np.array_equal(a, b)
    assert sum(int(h.sum()) for h in cnt1[0]) > 0


def test_not_usable_cases(models, warm):  # noqa: F811 - fixtures
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm))
    try:
        pg = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True, after=0, chunks=False)
        s.model.new_cache(20)
        assert pg.usable(12, 0)
        assert not pg.usable(12, 3)                        # chunks off: a later chunk runs eagerly
        assert not pg.usable(1, 0)                         # one token: the decode graphs' job
        assert not pg.usable(17, 0)                        # bucket 32 > the KV store's 20 rows
        assert not PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=False, after=0).usable(12, 0)
        chunks = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True, after=0, chunks=True)
        assert chunks.usable(12, 3)                        # later chunks on: bucket 16 from row 3 fits 20 rows
        assert not chunks.usable(12, 5)                    # rows 5 .. 20 past the store's 20
        s.model.new_cache(PREFILL_GRAPH_MAX + 8)
        assert not pg.usable(PREFILL_GRAPH_MAX + 1, 0)     # past the largest bucket: eager
    finally:
        s.close()


def test_env_off(monkeypatch, models, warm):  # noqa: F811 - fixtures
    from hybrid.runtime.prefill_graphs import prefill_chunk_graphs_enabled, prefill_graphs_enabled

    monkeypatch.delenv("HYBRID_PREFILL_GRAPH_CHUNKS", raising=False)
    assert prefill_chunk_graphs_enabled()                             # later chunks: on by default
    monkeypatch.setenv("HYBRID_PREFILL_GRAPH_CHUNKS", "0")
    assert not prefill_chunk_graphs_enabled()
    monkeypatch.setenv("HYBRID_PREFILL_GRAPH_CHUNKS", "1")
    assert prefill_chunk_graphs_enabled()

    monkeypatch.delenv("HYBRID_CUDA_GRAPHS", raising=False)
    monkeypatch.setenv("HYBRID_PREFILL_GRAPHS", "0")
    assert not prefill_graphs_enabled()
    monkeypatch.delenv("HYBRID_PREFILL_GRAPHS")
    assert prefill_graphs_enabled()
    monkeypatch.setenv("HYBRID_CUDA_GRAPHS", "0")                      # no graph at all
    assert not prefill_graphs_enabled()


def test_rows_for_widens_views_then_restores():
    """A bucket past the request's max_tokens runs on the store's rows (CUDA stores hold the session's
    context), the views and max_tokens as they were afterwards; past the store: an error."""
    big = KVCache(2, 64, 2, 4, torch.float32, [torch.device("cpu")] * 2)
    cache = KVCache(2, 20, 2, 4, torch.float32, [torch.device("cpu")] * 2, (big.k_store, big.v_store))
    k0 = cache.k
    with rows_for(cache, 32):
        assert cache.max_tokens == 32 and cache.k[1].shape[0] == 32 and cache.v[0].shape[0] == 32
        cache.write(1, 0, torch.ones(32, 2, 4), torch.ones(32, 2, 4))     # the padded rows fit
    assert cache.max_tokens == 20 and cache.k is k0 and cache.k[1].shape[0] == 20
    assert float(big.k_store[1][31].sum()) == 8.0                         # written into the shared store
    with rows_for(cache, 16):
        assert cache.max_tokens == 20                                     # fits: nothing changed
    with pytest.raises(ValueError, match="64"):
        with rows_for(cache, 128):
            pass


def test_a_bucket_runs_eagerly_at_its_first_prompt(models, warm):  # noqa: F811 - fixtures
    """PREFILL_GRAPH_AFTER = 1: the first prompt of a bucket runs eagerly (a capture costs about two eager
    prefills), the next ones through the graph; a bucket with a runner needs no count; a dropped one
    (residency or KV store changed) captures again at its next prompt."""
    from hybrid.runtime.prefill_graphs import PREFILL_GRAPH_AFTER

    assert PREFILL_GRAPH_AFTER == 1
    ids = tokenizer_for(models["nvfp4"]).encode(PROMPT * 3)
    assert len(ids) >= 20
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm))
    try:
        pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True)
        steps = []
        for n in (12, 13, 20, 14):                                        # buckets 16, 16, 32, 16
            s.model.prompt_tokens = n
            greedy_logits(s.model, ids[:n], 16)                           # a cache of >= 29 rows (CPU: the store)
            steps.append(pg.steps)
        assert steps == [0, 1, 1, 2]
        pg._runners.clear()                                               # as after a residency change
        s.model.new_cache(40)
        assert pg.usable(12, 0) and pg.usable(20, 0)                      # both buckets seen before
    finally:
        s.close()


def _chunked(model_dir, warm, ids, chunk, graphed, cap=None, n=8):
    s = open_session(model_dir, RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm, pcie_frac=0.0))
    try:
        pg = None
        if graphed:
            pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True,
                                                        after=0, chunks=True)
        s.model.prompt_tokens = len(ids)
        out, rows = greedy_logits(s.model, ids, n, chunk=chunk)
        hits = [c.hits.copy() for c in s.caches]
        keys = sorted(k[1:] for k in pg._runners) if pg else []
        return out, rows, hits, (pg.steps if pg else 0), keys
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_later_chunks_through_graphs(models, warm, kind):  # noqa: F811 - fixtures
    """HYBRID_PREFILL_GRAPH_CHUNKS: a 40-token prompt in chunks of 16 runs its three steps through graph bodies
    at starts 0, 16 and 32 (the last padded 8 -> 16 rows, its padded KV rows past the prompt never attended):
    the same greedy continuation, decode logits and cache counters as the eager chunked prefill."""
    ids = (tokenizer_for(models[kind]).encode(PROMPT) * 4)[:40]
    assert len(ids) == 40
    out0, rows0, hits0, _, _ = _chunked(models[kind], warm, ids, 16, graphed=False)
    out1, rows1, hits1, steps, keys = _chunked(models[kind], warm, ids, 16, graphed=True)
    assert steps == 3 and keys == [(16, 0), (16, 16), (16, 32)]
    assert out1 == out0
    tol = 1e-4 if kind == "bf16" else 1e-2
    torch.testing.assert_close(rows1, rows0, atol=tol, rtol=tol)
    for a, b in zip(hits0, hits1):
        assert np.array_equal(a, b)


def test_later_chunk_graphs_capped(monkeypatch, models, warm):  # noqa: F811 - fixtures
    """Past PREFILL_CHUNK_GRAPHS_MAX (bucket, start) pairs of later chunks, the next ones run eagerly."""
    from hybrid.runtime import prefill_graphs

    monkeypatch.setattr(prefill_graphs, "PREFILL_CHUNK_GRAPHS_MAX", 1)
    ids = (tokenizer_for(models["nvfp4"]).encode(PROMPT) * 4)[:40]
    _, _, _, steps, keys = _chunked(models["nvfp4"], warm, ids, 16, graphed=True)
    assert steps == 2 and keys == [(16, 0), (16, 16)]                 # the chunk at 32 ran eagerly


def test_later_chunk_past_the_cache_runs_eagerly(models, warm):  # noqa: F811 - fixtures
    """A later chunk whose bucket would reach past the KV store (40 tokens in chunks of 32, a cache of 43 rows:
    the 8-token chunk at 32 would pad to 16 rows, 48 > 43) runs eagerly after the graphed first chunk, with the
    eager chunked prefill's greedy ids and decode logits."""
    ids = (tokenizer_for(models["nvfp4"]).encode(PROMPT) * 4)[:40]
    out0, rows0, _, _, _ = _chunked(models["nvfp4"], warm, ids, 32, graphed=False, n=2)
    out1, rows1, _, steps, keys = _chunked(models["nvfp4"], warm, ids, 32, graphed=True, n=2)
    assert steps == 1 and keys == [(32, 0)]
    assert out1 == out0
    torch.testing.assert_close(rows1, rows0, atol=1e-2, rtol=1e-2)


def test_head_row_set_before_a_smaller_bucket_is_made(models, warm):  # noqa: F811 - fixtures
    """A bucket's runner is made (on CUDA: captured after an eager warm-up that selects the head's row of its
    B rows) only after the head's row is set for this prompt: a 40-token prompt (bucket 64, row 39) and then a
    12-token one (bucket 16) must make the 16-row head runner with row 11, not 39 (a device-side assert on
    CUDA, which ends the process)."""
    ids = (tokenizer_for(models["nvfp4"]).encode(PROMPT) * 4)[:40]
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm))
    try:
        pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True,
                                                    after=0)
        made, make = [], pg._make

        def spy(seg, b, start):
            if seg.head:
                made.append((b, int(pg._last_buf(seg.device).item())))
            return make(seg, b, start)

        pg._make = spy
        for n in (40, 12):
            s.model.prompt_tokens = n
            greedy_logits(s.model, ids[:n], 24)                        # a cache of >= 64 rows
        assert made == [(64, 39), (16, 11)]
    finally:
        s.close()


def test_a_prompt_just_past_the_largest_bucket_splits_into_graph_steps(monkeypatch, models, warm):  # noqa: F811
    """An n-token prompt with hi < n <= PREFILL_GRAPH_SPLIT_MAX, whose prefill would be one eager step, runs in
    hi-row graph steps (here hi = 16, 24 tokens: 16 at 0, then 8 padded to 8 rows at 16 with lo = 8): the same
    greedy ids and decode logits as the eager prefill; not past the split bound, not with a chunk below n, not
    when a layer can miss, not with later-chunk graphs off."""
    from hybrid.runtime import prefill_graphs

    ids = (tokenizer_for(models["nvfp4"]).encode(PROMPT) * 4)[:24]
    out0, rows0, _, _, _ = _chunked(models["nvfp4"], warm, ids, 0, graphed=False)
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_SPLIT_MAX", 32)
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm))
    try:
        pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True,
                                                    after=0, lo=8, hi=16)
        s.model.prompt_tokens = len(ids)
        out1, rows1 = greedy_logits(s.model, ids, 8)
        assert sorted(k[1:] for k in pg._runners) == [(8, 16), (16, 0)] and pg.steps == 2
        assert out1 == out0
        torch.testing.assert_close(rows1, rows0, atol=1e-2, rtol=1e-2)
        assert s.model.prefill_step(24, 24) == 16 and s.model.prefill_step(24, 4096) == 16
        assert s.model.prefill_step(24, 12) == 12                 # a chunk below n is the user's
        assert s.model.prefill_step(33, 33) == 33                 # past PREFILL_GRAPH_SPLIT_MAX
        assert s.model.prefill_step(16, 16) == 16                 # one bucket holds it
        pg.chunks = False
        assert s.model.prefill_step(24, 24) == 24                 # later-chunk graphs off
    finally:
        s.close()
    slots, extra, _ = PLACES["mixed"]
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=slots, expert_profile=warm, **extra))
    try:
        s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True,
                                               after=0, lo=8, hi=16)
        s.model.new_cache(40)
        assert s.model.prefill_step(24, 24) == 24                 # a layer that can miss: one eager step
    finally:
        s.close()


def test_bench_measure_prefills_twice_before_timing_with_graphs(models, warm):  # noqa: F811 - fixtures
    """hybrid-bench decode's measure: with prefill graphs on, a second warm-up prefill captures the bucket's
    graph (its first prompt runs eagerly), so the measured prefill replays it; without them one warm-up."""
    from hybrid.bench.decode import measure

    tok = tokenizer_for(models["nvfp4"])
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(LAYERS * EXPERTS,), expert_profile=warm))
    try:
        assert measure(s, tok, 16, 2, 3)["warmup_prefills"] == 1      # CPU session: no prefill graphs
        pg = s.model.prefill_graphs = PrefillGraphs(s.model.model, s.model.experts, capture=False, enabled=True)
        rec = measure(s, tok, 16, 2, 3)                                 # bucket 16 fits the 17-row cache
        assert rec["warmup_prefills"] == 2 and pg.steps == 2            # second warm-up and the measured one
    finally:
        s.close()

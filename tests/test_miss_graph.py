"""A can-miss layer's hits inside its decode graph (HYBRID_MISS_GRAPH, hybrid.runtime.miss_link)
against the old path (hits launched eagerly after the host sync): on the CPU (capture=False) the same
logits bit for bit, the same greedy ids, hit/miss counters, promotions, trace and final cache state,
with a small expert cache (layers miss and promote mid-decode), on one and two logical cards; the
host operations per can-miss layer counted; the device slot tables follow the cache in place. On a
GPU: greedy identity old vs new, graphs vs eager, one and two logical cards (and two GPUs)."""
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.experts.trace import read_trace
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.graphs import MISS_LAYER_HOST_OPS, DecodeGraphs, _Runner, miss_graph_enabled, plan_segments
from hybrid.runtime.hybrid_experts import HybridExperts
from hybrid.runtime.miss_link import MissLink
from hybrid.runtime.slots import host_moe
from hybrid.testing import greedy_logits, tokenizer_for, write_random_model
from tests.quant_layouts import to_nvfp4

LAYERS, EXPERTS, TOPK = 4, 16, 4
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("missgraph")
    bf16 = write_random_model(root / "bf16", "qwen3_moe", seed=5, skew=1.0, num_hidden_layers=LAYERS,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=64)
    return {"bf16": bf16, "nvfp4": to_nvfp4(bf16, root / "nvfp4", "modelopt")}




# cache slots per card (no expert profile: every cache starts empty and fills by promotion)
PLACES = {"one_card": dict(cache_slots=(6,)),
          "two_cards": dict(cache_slots=(6, 5), gpus=(0, 0), layer_split=(2,)),
          "fills_up": dict(cache_slots=(2 * EXPERTS, 6), gpus=(0, 0), layer_split=(2,)),   # card 0 ends full
          "no_slots": dict(cache_slots=(0,))}


def _cache_state(s):
    return [{k: getattr(c, k).copy() for k in ("table", "owner", "hits", "misses", "promotions", "evictions")}
            for c in s.caches]


def _session(path, tmp_path, name, miss_graph, place, **kw):
    s = open_session(path, RuntimeOptions(trace=str(tmp_path / f"{name}.jsonl"), cache_warm="profile", **PLACES[place],
                                          **kw))
    s.model.graphs = DecodeGraphs(s.model.model, s.model.experts, capture=False, enabled=True, bucket=8,
                                  miss_graph=miss_graph)
    return s


@pytest.mark.parametrize("place", ["no_slots", "two_cards"])
def test_cpu_direct_matches_the_pool(models, tmp_path, monkeypatch, place):
    """HYBRID_CPU_DIRECT (default on): a linked layer runs its misses on the calling thread
    (runner.run) instead of submit + sync through the pool's thread; the same logits bit for bit,
    each path's counters show it ran (every call pooled-sized: inline_bytes 0)."""
    ids = tokenizer_for(models["nvfp4"]).encode(PROMPT)
    runs = []
    for direct in ("0", "1"):
        monkeypatch.setenv("HYBRID_CPU_DIRECT", direct)
        s = _session(models["nvfp4"], tmp_path, f"d{direct}", True, place)
        try:
            runner = s.model.experts.cpu.runner
            runner.inline_bytes = 0
            assert s.model.experts.cpu_direct == (direct == "1")
            runs.append((greedy_logits(s.model, ids, STEPS), dict(runner.timing)))
        finally:
            s.close()
    ((ids0, l0), tm0), ((ids1, l1), tm1) = runs
    assert ids0 == ids1 and torch.equal(l0, l1)
    assert tm0["direct_calls"] == 0 and tm1["direct_calls"] > 0
    assert tm0["calls"] > tm1["calls"]            # the prompt's step still goes through the pool


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("place", sorted(PLACES))
def test_graph_hits_match_the_old_path(models, tmp_path, kind, place):
    path = models[kind]
    ids = tokenizer_for(path).encode(PROMPT)
    runs = []
    for mg in (False, True):
        s = _session(path, tmp_path, f"t{int(mg)}", mg, place)
        try:
            got = greedy_logits(s.model, ids, STEPS)
            runs.append((got, _cache_state(s), s.stats.to_dict(s.caches)["pcie_bytes"], s.stats.graph_steps,
                         sorted(s.model.graphs.links)))
        finally:
            s.close()
    (ids0, l0), cache0, pcie0, steps0, links0 = runs[0]
    (ids1, l1), cache1, pcie1, steps1, links1 = runs[1]
    assert steps0 == steps1 == STEPS
    assert links0 == [] and links1                     # the new path ran linked layers, the old none
    assert ids1 == ids0
    assert torch.equal(l1, l0)                         # the same ops in the same order: bit for bit
    for a, b in zip(cache0, cache1):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    if place != "no_slots":
        assert sum(c["promotions"].sum() for c in cache1) > 0       # promotions happened mid-decode
        assert sum(c["misses"].sum() for c in cache1) > 0
    assert pcie0 == pcie1
    t0, t1 = read_trace(tmp_path / "t0.jsonl"), read_trace(tmp_path / "t1.jsonl")
    assert len(t0.steps) == len(t1.steps)
    for a, b in zip(t0.steps, t1.steps):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights, b.weights)
        assert a.hits == b.hits and a.promotions == b.promotions


def test_full_layer_leaves_the_link(models, tmp_path):
    """Card 0's layers fill up by promotion and become graph-resident (no host work) mid-decode."""
    s = _session(models["nvfp4"], tmp_path, "f", True, "fills_up")
    try:
        greedy_logits(s.model, tokenizer_for(models["nvfp4"]).encode(PROMPT), STEPS)
        full = [s.model.experts.device_only(i) for i in range(LAYERS)]
        for c in s.cards:
            for layer, table in c.tables.items():          # device tables follow the cache, in place
                want = c.cache.slot_table(layer)
                want = np.where(want >= 0, want - c.slots.layer_slots[layer][0], -1)
                assert np.array_equal(table.numpy(), want)
                assert (layer in c.full) == bool((want >= 0).all())
                if layer in c.full:
                    assert c.full[layer] is table
    finally:
        s.close()
    assert full[:2] == [True, True] and full[2:] == [False, False]


def test_eager_combine_before_a_hop(models, tmp_path):
    """A linked layer whose next segment is on another device is combined on the host's side (eager
    ops, same values): forced here by segments planned without carry."""
    path = models["nvfp4"]
    ids = tokenizer_for(path).encode(PROMPT)
    outs = []
    for mg in (False, True):
        s = _session(path, tmp_path, f"c{int(mg)}", mg, "two_cards")
        g = s.model.graphs
        if mg:
            plan = g._segments
            g._segments = lambda plan=plan: [dataclasses.replace(seg, carry_in=None) for seg in plan()]
        try:
            outs.append(greedy_logits(s.model, ids, 6))
        finally:
            s.close()
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])


# ---- host operations per can-miss layer -------------------------------------------------------
class _HostOps(TorchDispatchMode):
    """A timeline of what the host issues in graphed steps: 'replay' (one runner run: a graph
    launch on CUDA), 'wait' (the event wait: MissLink.fetch) and every torch op called outside a
    runner body, the CPU runner and the promotions (counted on their own)."""

    def __init__(self):
        super().__init__()
        self.paused, self.timeline, self.promote_calls = 0, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.timeline.append(("op", func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _count_host_ops(s, monkeypatch, ids, n):
    ops = _HostOps()

    def paused(fn, mark=None):
        def wrap(*a, **kw):
            if mark and not ops.paused:
                ops.timeline.append(mark)
            ops.paused += 1
            try:
                return fn(*a, **kw)
            finally:
                ops.paused -= 1
        return wrap

    run = _Runner.run
    monkeypatch.setattr(_Runner, "run", lambda self: paused(run, ("replay", self))(self))
    monkeypatch.setattr(MissLink, "fetch", paused(MissLink.fetch, ("wait",)))
    monkeypatch.setattr(HybridExperts, "_promote", paused(HybridExperts._promote, ("promote",)))
    monkeypatch.setattr(HybridExperts, "end_step", paused(HybridExperts.end_step))
    monkeypatch.setattr(DecodeGraphs, "_make", paused(DecodeGraphs._make))   # once per graph (capture)
    cpu = s.model.experts.cpu
    monkeypatch.setattr(cpu, "submit", paused(cpu.submit))
    monkeypatch.setattr(cpu, "sync", paused(cpu.sync))
    s.model.new_cache(len(ids) + n + 1)
    logits = s.model.forward(torch.tensor(ids), 0, last_only=True)        # prefill: not graphed
    with ops:
        for step in range(n):
            logits = s.model.forward(torch.tensor([int(logits[-1].argmax())]), len(ids) + step, last_only=True)
    return ops.timeline


def _per_miss_layer(timeline):
    """Host operations of each can-miss layer: its replay and everything until the next replay,
    promotions not counted (they are rare and the same in both paths)."""
    out, cur = [], None
    for item in timeline:
        if item[0] == "replay":
            if cur is not None:
                out.append(cur)
            cur = [] if getattr(item[1], "host_last", False) else None
            if cur is not None:
                cur.append("replay")
        elif cur is not None and item[0] != "promote":
            cur.append(item[1] if item[0] == "op" else item[0])
    return out


@pytest.mark.parametrize("mg", [True, False])
def test_host_ops_per_miss_layer(models, tmp_path, monkeypatch, mg):
    path = models["nvfp4"]
    s = _session(path, tmp_path, "ops", mg, "two_cards")
    make = DecodeGraphs._make

    def tagged(self, seg, keys, x):                    # runners remember whether their segment can miss
        r = make(self, seg, keys, x)
        r.host_last = seg.host_last
        return r

    monkeypatch.setattr(DecodeGraphs, "_make", tagged)
    try:
        timeline = _count_host_ops(s, monkeypatch, tokenizer_for(path).encode(PROMPT), 6)
        misses = int(sum(c.misses.sum() for c in s.caches))
    finally:
        s.close()
    layers = _per_miss_layer(timeline)
    assert misses and len(layers) >= 6 * (LAYERS - 1)            # every can-miss layer but the last
    counts = sorted({len(ops) for ops in layers})
    if mg:
        # replay and wait; the CPU sum goes up inside the next graph (a host write before it)
        assert all(ops == ["replay", "wait"] for ops in layers) and counts == [MISS_LAYER_HOST_OPS]
    else:
        # the old path: its eager grouped kernel, adds, casts and the next input's copy (on a GPU
        # also the copies and events the CPU stand-in does not show)
        assert min(counts) > MISS_LAYER_HOST_OPS


def test_miss_graph_env(monkeypatch):
    monkeypatch.delenv("HYBRID_MISS_GRAPH", raising=False)
    assert miss_graph_enabled()
    monkeypatch.setenv("HYBRID_MISS_GRAPH", "0")
    assert not miss_graph_enabled()


def test_plan_segments_with_carry():
    cpu, other = torch.device("cpu"), torch.device("meta")
    every = lambda i: True  # noqa: E731
    resident = {0, 2, 3}

    def cut(devs, head, linked=every, resident=lambda i: False):
        return [(s.layers, s.host_last, s.head, s.linked, s.carry_in)
                for s in plan_segments(devs, resident, head, linked)]

    assert cut([cpu] * 4, cpu, resident=lambda i: i in resident) == [
        ((0, 1), True, False, True, None), ((2, 3), False, True, False, 1)]
    assert cut([cpu] * 3, cpu) == [                                  # the last layer can miss: head alone
        ((0,), True, False, True, None), ((1,), True, False, True, 0), ((2,), True, False, True, 1),
        ((), False, True, False, 2)]
    assert plan_segments([cpu] * 3, lambda i: False, cpu, every)[-1].device == cpu
    assert cut([cpu, cpu, other, other], other, resident=lambda i: i != 1) == [     # no carry over a hop
        ((0, 1), True, False, True, None), ((2, 3), False, True, False, None)]
    assert cut([cpu, cpu], other, resident=lambda i: i != 1) == [     # head elsewhere: the host combines
        ((0, 1), True, False, True, None)]
    assert cut([cpu] * 3, cpu, linked=lambda i: i != 1) == [          # layer 1 stays on the old path
        ((0,), True, False, True, None), ((1,), True, False, False, 0), ((2,), True, False, True, None),
        ((), False, True, False, 2)]
    assert cut([cpu] * 3, cpu, linked=None) == [                      # HYBRID_MISS_GRAPH=0: as before
        ((0,), True, False, False, None), ((1,), True, False, False, None), ((2,), True, False, False, None)]


def test_host_moe_skips_absent_slots():
    torch.manual_seed(0)
    host = [tuple(torch.randn(*shape) for shape in ((8, 16), (8, 16), (16, 8))) for _ in range(3)]
    x = torch.randn(1, 16).half()
    w = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tok = torch.zeros(4, dtype=torch.int32)
    got = host_moe(x, host, torch.tensor([2, -1, 0, -1], dtype=torch.int32), tok, w)
    want = host_moe(x, host, torch.tensor([2, 0], dtype=torch.int32), tok[:2], w[[0, 2]])
    assert torch.equal(got, want)
    assert torch.equal(host_moe(x, host, torch.full((4,), -1, dtype=torch.int32), tok, w), torch.zeros(1, 16))


# ---- on a GPU -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
GPU_PLACES = {"one_card": dict(cache_slots=(6,)),
              "two_cards": dict(cache_slots=(6, 5), layer_split=(2,)),
              "fills_up": dict(cache_slots=(2 * EXPERTS, 6), layer_split=(2,))}


def _gpu_run(path, ids, gpus, place, graphs: str, miss_graph: str, monkeypatch, n=STEPS):
    monkeypatch.setenv("HYBRID_CUDA_GRAPHS", graphs)
    monkeypatch.setenv("HYBRID_MISS_GRAPH", miss_graph)
    kw = dict(GPU_PLACES[place])
    if "layer_split" not in kw:
        gpus = gpus[:1]
    s = open_session(path, RuntimeOptions(device="cuda", gpus=gpus, pcie_frac=1.0, cache_warm="profile", **kw),
                     context=len(ids) + n + 2)
    try:
        out = greedy_logits(s.model, ids, n)
        g = s.model.graphs
        info = dict(steps=s.stats.graph_steps, error=g.error, links=sorted(g.links),
                    promotions=int(sum(c.promotions.sum() for c in s.caches)), cache=_cache_state(s))
    finally:
        s.close()
    return out, info


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gpus", [pytest.param((0, 0), id="one-gpu"),
                                  pytest.param((0, 1), id="two-gpus", marks=two_gpus)])
@pytest.mark.parametrize("place", sorted(GPU_PLACES))
def test_miss_graph_matches_old_path_on_cuda(models, place, gpus, monkeypatch):
    """Greedy ids of the graphed hits equal the old path's and the eager step's, with misses and
    promotions mid-decode; logits within 1e-2 (as the NVFP4 CPU comparison): on the GPU the grouped
    kernel is launched over all k pairs (-1 dropped) instead of the hits alone, so it may split K
    differently, and its fp32 atomics add in no fixed order (bit identity is the CPU test's)."""
    path = models["nvfp4"]
    ids = tokenizer_for(path).encode(PROMPT)
    eager, eager_info = _gpu_run(path, ids, gpus, place, "0", "0", monkeypatch)
    old, old_info = _gpu_run(path, ids, gpus, place, "1", "0", monkeypatch)
    new, new_info = _gpu_run(path, ids, gpus, place, "1", "1", monkeypatch)
    for info in (old_info, new_info):
        assert info["error"] is None and info["steps"] == STEPS
    assert eager_info["steps"] == 0
    assert old_info["links"] == [] and new_info["links"]
    assert new_info["promotions"] > 0
    assert new[0] == old[0] == eager[0]
    for a, b in zip(old_info["cache"], new_info["cache"]):     # the same lookups, promotions, evictions
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    torch.testing.assert_close(new[1], old[1], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(new[1], eager[1], atol=1e-2, rtol=1e-2)


CUDA_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemcpyAsync",
              "cudaMemsetAsync", "cudaGraphLaunch", "cudaEventRecord", "cudaEventRecordWithFlags",
              "cudaStreamWaitEvent", "cudaEventSynchronize", "cudaStreamSynchronize", "cudaMemcpy")


def _cuda_calls(model, ids, n):
    """CUDA runtime / driver calls the host makes in n graphed decode steps, by name."""
    from torch.profiler import ProfilerActivity, profile

    model.new_cache(len(ids) + 2 * n + 1)
    logits = model.forward(torch.tensor(ids), 0, last_only=True)
    pos = len(ids)
    for _ in range(n):                                 # warm: graphs captured, caches settled
        logits = model.forward(torch.tensor([int(logits[-1].argmax())]), pos, last_only=True)
        pos += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            logits = model.forward(torch.tensor([int(logits[-1].argmax())]), pos, last_only=True)
            pos += 1
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages() if e.key in CUDA_CALLS}


@cuda
@pytest.mark.cuda
def test_fewer_cuda_calls_per_step(models, monkeypatch):
    """The host's CUDA calls per graphed decode step with every layer able to miss: fewer with the
    hits in the graph (printed for the record: pytest -s)."""
    path = models["nvfp4"]
    ids = tokenizer_for(path).encode(PROMPT)
    counts = {}
    for mg in ("0", "1"):
        monkeypatch.setenv("HYBRID_MISS_GRAPH", mg)
        s = open_session(path, RuntimeOptions(device="cuda", cache_slots=(6,), pcie_frac=0.0, cache_warm="profile"),
                         context=len(ids) + 20)
        try:
            counts[mg] = _cuda_calls(s.model, ids, 8)
            assert s.model.graphs.error is None
        finally:
            s.close()
    per_step = {mg: sum(c.values()) / 8 for mg, c in counts.items()}
    print(f"CUDA calls per decode step ({LAYERS} can-miss layers): old {per_step['0']:.1f} {counts['0']}, "
          f"graph hits {per_step['1']:.1f} {counts['1']}")
    assert per_step["1"] < per_step["0"]


def test_miss_link_row_and_cpu_sum():
    link = MissLink(k=2, hidden=3, dtype=torch.float16, device=torch.device("cpu"))
    link.row.copy_(torch.tensor([[5.0, 1.0, 0.75, 0.25]]))          # what the router launch writes
    link.send(torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float16), torch.tensor([3, -1], dtype=torch.int32))
    ids, w, local, h = link.fetch()
    assert ids.tolist() == [[5, 1]] and w.tolist() == [[0.75, 0.25]] and local.tolist() == [[3, -1]]
    assert h.tolist() == [[1.0, -2.0, 0.5]]
    link.keep(torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float16), torch.tensor([[0.5, 0.5, 0.5]]))
    link.put(np.array([[0.25, 0.0, -0.5]], dtype=np.float32))       # a host write; combine copies it up
    assert link.dirty and not link.yc.any()
    model = type("M", (), {"layers": [type("L", (), {"shared": None})()],
                           "moe_out": staticmethod(lambda layer, h, y: y)})()
    assert link.combine(model, 0).tolist() == [[1.75, 1.5, 1.0]]      # xm + round(yh + yc)
    assert link.yc.tolist() == [[0.25, 0.0, -0.5]]
    link.put(None)                                                    # no misses: the CPU part reads 0
    assert not link.dirty and link.combine(model, 0).tolist() == [[1.5, 1.5, 1.5]] and not link.yc.any()


def test_graph_safe_slot_storage(models):
    """Which storages a captured graph can run over every routed pair: QPN on a card or none (CPU
    stand-ins and the torch reference storage keep the old path when capturing)."""
    s = open_session(models["nvfp4"], RuntimeOptions(cache_slots=(6, 0), gpus=(0, 0), layer_split=(2,)))
    try:
        e = s.model.experts
        assert [e.has_slots(i) for i in range(LAYERS)] == [True, True, False, False]
        assert [e.graph_hits(i) for i in range(LAYERS)] == [False, False, True, True]   # CPU card: host storage
        g = DecodeGraphs(s.model.model, e, capture=True, enabled=True, miss_graph=True)
        assert [g._linkable(i) for i in range(LAYERS)] == [False, False, True, True]
        g.capture = False
        assert all(g._linkable(i) for i in range(LAYERS))
    finally:
        s.close()

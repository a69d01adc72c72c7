"""Overlapped decode (hybrid.generate: the next id sampled on the device and fed to the next step,
which is enqueued before the host reads the token; HybridModel.enqueue / finish / discard), checked on
the CPU with the graph pieces run eagerly (DecodeGraphs capture=False): the same greedy ids, cache
counters, trace records and step counts as the loop without overlap, for every placement (all
resident: steps run ahead; with misses: the fallback), a discarded speculative step at EOS / a stop
string counts nothing; DeviceSampler = Sampler (greedy with penalties, seeded sampling). The same on a
GPU at the end (skipped without CUDA)."""
import json

import numpy as np
import pytest
import torch

from hybrid.generate import generate
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.runtime.graphs import DecodeGraphs
from hybrid.sampler import DeviceSampler, Sampler, SamplerConfig
from hybrid.testing import tokenizer_for, write_random_model
from tests.quant_layouts import to_nvfp4

LAYERS, EXPERTS, TOPK, TOKENS = 4, 16, 4, 10
PROMPT = "def fibonacci(n):\n    if n < 2:"
PLACES = {"all_resident": ((LAYERS * EXPERTS,), {}),
          "two_cards_resident": ((2 * EXPERTS,), dict(gpus=(0, 0), layer_split=(2,))),
          "mixed": ((2 * EXPERTS, 20), dict(gpus=(0, 0), layer_split=(2,))),
          "all_cpu": ((0,), {})}
RESIDENT = ("all_resident", "two_cards_resident")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    bf16 = write_random_model(root / "bf16", "qwen3_moe", seed=5, skew=1.0, num_hidden_layers=LAYERS,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=64)
    return to_nvfp4(bf16, root / "nvfp4", "modelopt")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """An expert profile where every expert is used: a warm start fills every slot it is given."""
    from hybrid.experts.popularity import profile_file_dict

    counts = np.full((LAYERS, EXPERTS), 64 * TOPK // EXPERTS, dtype=np.int64)
    path = tmp_path_factory.mktemp("warm") / "experts.json"
    path.write_text(json.dumps(profile_file_dict("overlap", "qwen3_moe", counts, 64, TOPK, {"test": True})))
    return str(path)


class Counted:
    """Counts a HybridModel's enqueue / discard calls."""

    def __init__(self, hm):
        self.enqueued = self.discarded = 0
        enqueue, discard = hm.enqueue, hm.discard

        def enq(*a, **kw):
            self.enqueued += 1
            return enqueue(*a, **kw)

        def dis(*a, **kw):
            self.discarded += 1
            return discard(*a, **kw)

        hm.enqueue, hm.discard = enq, dis


def run(model_dir, warm, place, overlap, tmp_path, sampler=None, tokens=TOKENS, stop=None, eos=None):
    slots, extra = PLACES[place]
    trace = tmp_path / f"{place}-{overlap}.jsonl"
    tok = tokenizer_for(model_dir)
    if eos is not None:
        tok.eos_ids = {eos}
    s = open_session(model_dir, RuntimeOptions(cache_slots=slots, expert_profile=warm, pcie_frac=0.0,
                                               trace=str(trace), **extra))
    try:
        hm = s.model
        hm.graphs = DecodeGraphs(hm.model, hm.experts, capture=False, enabled=True, bucket=8)
        count = Counted(hm)
        hm.prompt_tokens = len(tok.encode(PROMPT))
        res = generate(hm, tok, tok.encode(PROMPT), tokens, sampler or Sampler(SamplerConfig()), stop=stop,
                       overlap=overlap)
        out = {"ids": res.generated_ids, "text": res.text, "stop": res.stop_reason,
               "hits": [c.hits.copy() for c in s.caches], "misses": [c.misses.copy() for c in s.caches],
               "steps": dict(s.stats.steps), "graph_steps": s.stats.graph_steps, "kv_length": hm.model.cache.length,
               "cache_steps": [c.step for c in s.caches], "count": count, "decode_s": res.decode_s}
    finally:
        s.close()
    lines = [json.loads(x) for x in trace.read_text().splitlines()[1:]]
    out["trace"] = [{k: v for k, v in d.items() if k != "timings"} for d in lines]
    return out


def same_run(a, b):
    assert a["ids"] == b["ids"] and a["text"] == b["text"] and a["stop"] == b["stop"]
    assert all(np.array_equal(x, y) for x, y in zip(a["hits"], b["hits"]))
    assert all(np.array_equal(x, y) for x, y in zip(a["misses"], b["misses"]))
    for key in ("steps", "graph_steps", "kv_length", "cache_steps", "trace"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("place", sorted(PLACES))
def test_overlap_matches_plain_loop(model_dir, warm, place, tmp_path):
    """Greedy ids, hit/miss counters, trace records, step counts: equal with and without overlap;
    all-resident steps run ahead, steps with misses fall back to the plain forward."""
    off = run(model_dir, warm, place, False, tmp_path)
    on = run(model_dir, warm, place, True, tmp_path)
    same_run(off, on)
    assert len(on["ids"]) == TOKENS and on["steps"]["decode"] == TOKENS - 1
    assert off["count"].enqueued == 0
    assert on["count"].enqueued == (TOKENS - 1 if place in RESIDENT else 0)
    assert on["count"].discarded == 0


@pytest.mark.parametrize("tokens", [1, 2])
def test_overlap_short_generations(model_dir, warm, tokens, tmp_path):
    """max_tokens 1 (no decode step) and 2 (one, never a speculative one): as the plain loop."""
    off = run(model_dir, warm, "all_resident", False, tmp_path, tokens=tokens)
    on = run(model_dir, warm, "all_resident", True, tmp_path, tokens=tokens)
    same_run(off, on)
    assert len(on["ids"]) == tokens and on["count"].enqueued == tokens - 1 and on["count"].discarded == 0


@pytest.mark.parametrize("end", ["eos", "stop"])
def test_discarded_step_counts_nothing(model_dir, warm, end, tmp_path):
    """EOS / a stop string at token 4: the step enqueued ahead (for token 5) is discarded; the counters,
    trace and KV length equal the plain loop's, which never ran it."""
    ref = run(model_dir, warm, "all_resident", False, tmp_path)
    kw = {"eos": ref["ids"][4]} if end == "eos" else {"stop": [_piece_at(model_dir, ref["ids"], 4)]}
    off = run(model_dir, warm, "all_resident", False, tmp_path, **kw)
    on = run(model_dir, warm, "all_resident", True, tmp_path, **kw)
    same_run(off, on)
    assert on["stop"] == end and on["count"].discarded == 1
    assert on["steps"]["decode"] < TOKENS - 1


def test_eos_first_token(model_dir, warm, tmp_path):
    """EOS as the first token (from the prefill): nothing was enqueued ahead, nothing decoded."""
    ref = run(model_dir, warm, "all_resident", False, tmp_path, tokens=3)
    off = run(model_dir, warm, "all_resident", False, tmp_path, eos=ref["ids"][0])
    on = run(model_dir, warm, "all_resident", True, tmp_path, eos=ref["ids"][0])
    same_run(off, on)
    assert on["ids"] == [] and on["stop"] == "eos" and on["count"].enqueued == on["count"].discarded == 0


def _piece_at(model_dir, ids, i):
    """A stop string that first appears with token i."""
    tok = tokenizer_for(model_dir)
    before, upto = tok.decode(ids[:i]), tok.decode(ids[:i + 1])
    for n in range(1, len(upto) + 1):
        s = upto[-n:]
        if s not in before and s.strip():
            return s
    pytest.skip("token adds no text")


def test_overlap_sampled_matches_on_cpu(model_dir, warm, tmp_path):
    """Seeded sampling with every option: on the CPU the device sampler's draw is Sampler's."""
    cfg = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.2,
               seed=3)
    off = run(model_dir, warm, "all_resident", False, tmp_path, sampler=Sampler(SamplerConfig(**cfg)))
    on = run(model_dir, warm, "all_resident", True, tmp_path, sampler=Sampler(SamplerConfig(**cfg)))
    same_run(off, on)


def test_cpu_mode_keeps_the_plain_loop(model_dir, warm, tmp_path, monkeypatch):
    """overlap=None: only with logits on CUDA, even with HYBRID_DECODE_OVERLAP=1."""
    monkeypatch.setenv("HYBRID_DECODE_OVERLAP", "1")
    out = run(model_dir, warm, "all_resident", None, tmp_path)
    assert out["count"].enqueued == 0


SAMPLINGS = [dict(), dict(presence_penalty=0.7), dict(repetition_penalty=1.3),
             dict(repetition_penalty=0.8, presence_penalty=-0.2),
             dict(temperature=0.7, seed=1), dict(temperature=1.2, top_k=5, seed=2),
             dict(temperature=0.9, top_p=0.6, seed=3), dict(temperature=1.0, min_p=0.1, seed=4),
             dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.01, presence_penalty=0.3,
                  repetition_penalty=1.1, seed=5)]


def _compare_samplers(device, cfg, rounds=40, vocab=512):
    g = torch.Generator().manual_seed(0)
    history = [3, 7, 7, 100, 511]
    ref, dev = Sampler(SamplerConfig(**cfg)), Sampler(SamplerConfig(**cfg))
    ds = DeviceSampler(dev, history, vocab, device)
    want, got = [], []
    h = list(history)
    for _ in range(rounds):
        logits = torch.randn(vocab, generator=g) * 3
        a = ref(logits, h)
        tok, host = ds(logits.to(device))
        want.append(a)
        got.append(host.read())
        assert int(tok.cpu()) == got[-1]
        h.append(a)
        if got[-1] != a and ds.seen is not None:    # both samplers' seen sets on the same history
            ds.seen[got[-1]] = got[-1] in h
            ds.seen[a] = True
    return want, got


@pytest.mark.parametrize("cfg", SAMPLINGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "greedy")
def test_device_sampler_equals_sampler_on_cpu(cfg):
    want, got = _compare_samplers("cpu", cfg)
    assert got == want


# ---- on a GPU -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", SAMPLINGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "greedy")
def test_device_sampler_on_cuda(cfg):
    """Greedy and the penalties: the same ids as Sampler; seeded sampling: the same random stream,
    ids equal unless the device's softmax / cumsum round differently at a boundary (allowed: 2 of 40)."""
    want, got = _compare_samplers("cuda", cfg)
    diff = sum(a != b for a, b in zip(want, got))
    assert diff == 0 if not cfg.get("temperature") else diff <= 2


def same_records(a: list[dict], b: list[dict], atol: float = 1e-3) -> bool:
    """Trace records equal, their routing weights within atol: two sessions' CUDA graphs of the same step can
    differ by an fp16 rounding (results/runtime.md §42), which moves the weights in their fifth decimal."""
    def close(x: dict, y: dict) -> bool:
        if x.keys() != y.keys() or any(x[k] != y[k] for k in x if k != "weights"):
            return False
        return "weights" not in x or np.allclose(np.asarray(x["weights"]), np.asarray(y["weights"]), atol=atol, rtol=0)

    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))


def test_same_records():
    rec = {"type": "step", "ids": [[[1, 2]]], "weights": [[[0.6, 0.4]]], "hits": [2]}
    assert same_records([rec], [dict(rec, weights=[[[0.6004, 0.3996]]])])
    assert not same_records([rec], [dict(rec, weights=[[[0.61, 0.39]]])])
    assert not same_records([rec], [dict(rec, ids=[[[1, 3]]])])
    assert not same_records([rec], [rec, rec])


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("reduce", ["atomic", "ordered"])
@pytest.mark.parametrize("place", ["all_resident", "mixed"])
def test_overlap_on_cuda(model_dir, warm, place, reduce, tmp_path, monkeypatch):
    """CUDA graphs: greedy ids, counters, trace records equal with and without overlap (steps run
    ahead only all-resident), and with an EOS the discarded step counts nothing. The trace's routing weights:
    equal bit for bit with the MoE down kernel's ordered sum (HYBRID_MOE_REDUCE=ordered), within same_records'
    1e-3 with its atomics (the default)."""
    monkeypatch.setenv("HYBRID_MOE_REDUCE", reduce)
    same = (lambda a, b: a == b) if reduce == "ordered" else same_records
    def session_run(overlap, eos=None):
        slots = PLACES[place][0]
        slots = slots if len(slots) == 2 else (slots[0] // 2,)
        trace = tmp_path / f"c{place}{overlap}{eos}.jsonl"
        tok = tokenizer_for(model_dir)
        if eos is not None:
            tok.eos_ids = {eos}
        ids = tok.encode(PROMPT)
        s = open_session(model_dir, RuntimeOptions(device="cuda", gpus=(0, 0), layer_split=(2,), cache_slots=slots,
                                                   expert_profile=warm, pcie_frac=0.0, trace=str(trace),
                                                   cpu_engine="torch",   # no Numba compile (minutes, cold)
                                                   cache_warm="profile"),
                         context=len(ids) + 16)
        try:
            hm = s.model
            count = Counted(hm)
            hm.prompt_tokens = len(ids)
            res = generate(hm, tok, ids, 12, Sampler(SamplerConfig()), overlap=overlap)
            out = (res.generated_ids, [c.hits.copy() for c in s.caches], [c.misses.copy() for c in s.caches],
                   dict(s.stats.steps), s.stats.graph_steps, hm.model.cache.length, hm.graphs.error)
        finally:
            s.close()
        lines = [{k: v for k, v in json.loads(x).items() if k != "timings"} for x in trace.read_text().splitlines()]
        return out, lines, count

    (o0, t0, _), (o1, t1, c1) = session_run(False), session_run(True)
    assert o0[0] == o1[0] and o0[3:] == o1[3:] and o1[6] is None
    assert all(np.array_equal(a, b) for a, b in zip(o0[1] + o0[2], o1[1] + o1[2]))
    assert same(t0[1:], t1[1:])
    assert c1.enqueued == (11 if place == "all_resident" else 0)
    eos = o0[0][5]
    first = o0[0].index(eos)                                   # the generation ends at its first occurrence
    (e0, u0, _), (e1, u1, d1) = session_run(False, eos=eos), session_run(True, eos=eos)
    assert e0[0] == e1[0] == o0[0][:first] and e0[3:] == e1[3:] and same(u0[1:], u1[1:])
    assert all(np.array_equal(a, b) for a, b in zip(e0[1] + e0[2], e1[1] + e1[2]))
    assert d1.discarded == (1 if place == "all_resident" and first > 0 else 0)


@cuda
@pytest.mark.cuda
def test_overlap_embeds_from_host_table(model_dir, warm, monkeypatch):
    """Steps that run ahead embed their device-side id from the pinned host table (HYBRID_HOST_EMBED, the default):
    no copy of the table on the card, the same greedy ids as with that copy (HYBRID_HOST_EMBED=0) and as the plain
    loop. The session makes either table at load (the decode overlaps by default), not at the second token."""
    tok = tokenizer_for(model_dir)
    ids = tok.encode(PROMPT)

    def run(flag, overlap=True):
        monkeypatch.setenv("HYBRID_HOST_EMBED", flag)
        s = open_session(model_dir, RuntimeOptions(device="cuda", cache_slots=PLACES["all_resident"][0],
                                                   expert_profile=warm, pcie_frac=0.0, cpu_engine="torch",
                                                   cache_warm="profile"), context=len(ids) + 16)
        try:
            hm = s.model
            g = hm.graphs
            at_load = g._host_embed is not None, g._embed_table is not None
            hm.prompt_tokens = len(ids)
            res = generate(hm, tok, ids, 12, Sampler(SamplerConfig()), overlap=overlap)
            return res.generated_ids, g._host_embed is not None, g._embed_table is not None, g.error, at_load
        finally:
            s.close()

    host, card, plain = run("1"), run("0"), run("1", overlap=False)
    assert host[1:] == (True, False, None, (True, False)) and card[1:] == (False, True, None, (False, True))
    assert host[0] == card[0] == plain[0]

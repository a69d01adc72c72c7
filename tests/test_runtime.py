"""Hybrid runtime in CPU mode: greedy output identical to the reference model for every placement
(all experts on the CPU runner, cache at 0/50/100 %, the split at every layer, one or two logical
cards), on BF16, NVFP4 and mixed NVFP4/FP8 checkpoints; hit rates equal an offline replay of the
run's own trace."""
import json

import numpy as np
import pytest
import torch

from hybrid.experts.replay import replay_run, verify
from hybrid.experts.trace import read_trace
from hybrid.generate import generate
from hybrid.model.config import ModelConfig
from hybrid.model.loader import load_model
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.testing import write_random_model
from hybrid.tokenizer import Tokenizer
from tests.quant_layouts import to_nvfp4

LAYERS, EXPERTS, TOPK = 4, 16, 4
PROMPT = "def fibonacci(n):\n    if n < 2:"
N_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    bf16 = write_random_model(root / "bf16", "qwen3_moe", seed=3, skew=1.0, num_hidden_layers=LAYERS,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK,
                              moe_intermediate_size=64)   # QPN kernels take in-features % 64
    return {"bf16": bf16, "nvfp4": to_nvfp4(bf16, root / "nvfp4", "modelopt"),
            "mixed": to_nvfp4(bf16, root / "mixed", "mixed")}


def _tok(path):
    cfg = ModelConfig.from_folder(path)
    return Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)


def _greedy(model, path, n=N_TOKENS, chunk=0):
    tok = _tok(path)
    res = generate(model, tok, tok.encode(PROMPT), n, Sampler(SamplerConfig()), prefill_chunk=chunk)
    return res.generated_ids


@pytest.fixture(scope="module")
def reference(models):
    return {k: _greedy(load_model(p), p) for k, p in models.items()}


def _run(path, **kw):
    s = open_session(path, RuntimeOptions(**kw))
    try:
        out = _greedy(s.model, path, chunk=s.prefill_chunk)
    finally:
        s.close()
    return out, s


HALF = LAYERS * EXPERTS // 2
PLACEMENTS = {
    "all_cpu": dict(cache_slots=(0,)),
    "cache_50": dict(cache_slots=(HALF,)),
    "cache_100": dict(cache_slots=(LAYERS * EXPERTS,)),
    "two_cards_split1": dict(gpus=(0, 0), layer_split=(1,), cache_slots=(8,)),
    "two_cards_split2": dict(gpus=(0, 1), layer_split=(2,), cache_slots=(0, 32)),
    "two_cards_split3": dict(gpus=(0, 0), layer_split=(3,), cache_slots=(48, 4)),
    "three_cards": dict(gpus=(0, 0, 0), layer_split=(1, 3), cache_slots=(16,)),
    "chunked_prefill": dict(cache_slots=(HALF,), prefill_chunk=3),
    "torch_cpu_engine": dict(cache_slots=(HALF,), cpu_engine="torch"),
}


@pytest.mark.parametrize("kind", ["bf16", "nvfp4", "mixed"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_greedy_identical_to_reference(models, reference, kind, placement):
    got, s = _run(models[kind], **PLACEMENTS[placement])
    assert got == reference[kind], placement
    rep = s.report()
    if kind != "bf16" and rep["cards"] and any(c.spec.slots for c in s.cards):
        assert rep["slot_storage"] == ["QPNSlots"]          # hits through qpn_moe (torch reference)
    torch_engine = kind == "bf16" or PLACEMENTS[placement].get("cpu_engine") == "torch"
    assert rep["cpu_runner"] == ("TorchCpuRunner" if torch_engine else "NumbaCpuRunner")
    slots = PLACEMENTS[placement]["cache_slots"]
    assert sum(c["slots"] for c in rep["cards"]) == sum(min(x, 64) for x in
                                                        (slots * len(s.cards) if len(slots) == 1 else slots))
    if slots == (0,):
        assert rep["hit_rate"] == 0.0 and rep["cpu_expert_ms"] > 0 and rep["gpu_expert_ms"] == 0
    if slots == (LAYERS * EXPERTS,):   # every expert resident from load (--cache-warm auto): all hits
        assert rep["hit_rate"] == 1.0 and all(c["promotions"] == c["evictions"] == 0 for c in rep["cards"])


@pytest.mark.parametrize("warm, atol", [("off", 1e-4), ("auto", 2e-3)])
def test_logits_match_reference(models, warm, atol):
    """Teacher-forced logits through the hybrid path vs the reference (fp32, stated tolerance). warm off: the
    slots start empty, the experts mostly run on the CPU runner (fp32 / int16 activations); auto: the slots
    start full (experts in id order), most experts run through the slots' QPN path, whose activations are
    fp16 (relative rounding 2^-11), hence its wider tolerance."""
    path = models["nvfp4"]
    ids = torch.tensor(_tok(path).encode(PROMPT))
    want = load_model(path).forward_logits(ids)
    s = open_session(path, RuntimeOptions(gpus=(0, 0), layer_split=(2,), cache_slots=(10, 20), cache_warm=warm))
    warmed = [(sum(map(len, c.cache.warm.values())), sum(c.cache.capacities)) for c in s.cards]
    got = s.model.forward_logits(ids)
    s.close()
    assert all(n == (cap if warm == "auto" else 0) for n, cap in warmed), warmed
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("policy", ["lfu-decay", "lru"])
def test_hit_rates_equal_replay_of_own_trace(models, tmp_path, policy):
    trace_path = tmp_path / "t.jsonl"
    _, s = _run(models["nvfp4"], gpus=(0, 0), layer_split=(2,), cache_slots=(12, 20), policy=policy,
                trace=str(trace_path))
    rep = s.report()
    trace = read_trace(trace_path)
    assert len(trace.steps) == N_TOKENS   # prefill + N-1 decode steps
    assert trace.steps[0].phase == "prefill" and trace.steps[-1].phase == "decode"
    assert verify(trace) == []
    res = replay_run(trace)
    assert res.hit_rate == pytest.approx(rep["hit_rate"], abs=1e-6)
    for card, cache in zip(rep["cards"], res.caches):
        assert card["hit_rate"] == pytest.approx(cache.stats().hit_rate(), abs=1e-6)
        assert card["promotions"] == int(cache.promotions.sum())
    assert 0 < rep["hit_rate"] < 1


def _profile(path, out):
    from hybrid.cli.profile import main

    texts = out.parent / "calib.txt"
    texts.write_text("def fibonacci(n):\n    return n\n\nThe quick brown fox jumps over the lazy dog.\n")
    assert main(["--model", str(path), "--out", str(out), "--prompts", str(texts), "--max-tokens", "4"]) == 0
    return out


@pytest.mark.parametrize("warm", ["auto", "profile", "off"])
def test_cache_warm_modes(models, reference, tmp_path, warm):
    """--cache-warm: without an expert profile auto fills the slots with experts in id order (every expert of a
    layer whose slots hold them all), profile and off leave them empty; with one, auto and profile fill them
    with its most used experts and off leaves them empty (the policy still seeded). Greedy ids unchanged."""
    from hybrid.errors import HybridError

    prof = _profile(models["nvfp4"], tmp_path / "p.experts.json")
    top = json.loads(prof.read_text())
    for eprof in (None, str(prof)):
        got, s = _run(models["nvfp4"], gpus=(0, 0), layer_split=(2,), cache_slots=(2 * EXPERTS, 6),
                      expert_profile=eprof, cache_warm=warm)
        assert got == reference["nvfp4"]
        filled = [dict(c.cache.warm) for c in s.cards]
        ws = s.report()["warm_start"]                        # what --stats / --json report
        n = sum(len(v) for f in filled for v in f.values())
        assert ws == {"experts": n, "slots": 2 * EXPERTS + 6, "mode": warm,
                      "source": "none" if not n else "id order" if eprof is None else "expert profile"}
        assert f"warm start (--cache-warm {warm}): {n} of {2 * EXPERTS + 6} slots filled at load" in s.summary()[-1]
        if warm == "off" or (warm == "profile" and eprof is None):
            assert filled == [{}, {}]
        elif eprof is None:                                  # id order: all of card 0's, 0..5 on card 1
            assert filled == [{0: list(range(EXPERTS)), 1: list(range(EXPERTS))}, {2: [0, 1, 2], 3: [0, 1, 2]}]
        else:                                                # the profile's most used, as many as fit
            c = np.asarray(top["counts"])
            assert sorted(filled[1][3]) == sorted(np.argsort(-c[3], kind="stable")[:3].tolist())
        assert all(c.cache.seeded == (eprof is not None) for c in s.cards)
    with pytest.raises(HybridError, match="--cache-warm"):
        RuntimeOptions(cache_warm="hot")


def test_warm_start_from_profile_replays(models, reference, tmp_path):
    prof = _profile(models["nvfp4"], tmp_path / "p.experts.json")
    d = json.loads(prof.read_text())
    assert np.asarray(d["counts"]).sum(1).tolist() == [d["tokens"] * TOPK] * LAYERS
    trace_path = tmp_path / "t.jsonl"
    got, s = _run(models["nvfp4"], cache_slots=(HALF,), expert_profile=str(prof), trace=str(trace_path))
    assert got == reference["nvfp4"]
    trace = read_trace(trace_path)
    assert trace.header.cards[0]["seeded"] and trace.steps[0].hits[0] > 0   # hits from the first step
    assert verify(trace) == []


def test_static_policy_never_promotes_after_warm_start(models, tmp_path):
    prof = _profile(models["bf16"], tmp_path / "p.experts.json")
    _, s = _run(models["bf16"], cache_slots=(HALF,), expert_profile=str(prof), policy="static")
    assert all(c["promotions"] == 0 for c in s.report()["cards"])


def test_plan_drives_placement_and_zero_pcie_budget(models, reference):
    """With a hardware profile the planner places layers and slots; --pcie-frac 0 forbids promotions."""
    got, s = _run(models["nvfp4"], gpus=(0, 1), layer_split=(1,), cache_slots=(8,), profile="v100x2-e5v4",
                  pcie_frac=0.0)
    assert got == reference["nvfp4"]
    assert [c.spec.layers for c in s.cards] == [(0, 1), (1, LAYERS)]
    rep = s.report()
    # no promotions; the slots were filled at load (--cache-warm auto, experts in id order), so some hits
    assert all(c["promotions"] == 0 for c in rep["cards"]) and rep["hit_rate"] > 0.0
    assert rep["prediction"]["tok_s"] > 0 and rep["prediction"]["profile"] == "v100x2-e5v4"
    # --prefill-chunk auto: the plan's (the tiny model fits a 16 GB card at any chunk: the largest)
    assert rep["prefill_chunk"] == {"tokens": 4096, "source": "plan"} == {"tokens": s.plan.inputs.prefill_chunk,
                                                                          "source": "plan"}
    assert "prefill chunk: 4096 tokens (plan)" in s.summary()
    _, s = _run(models["nvfp4"], cache_slots=(HALF,), prefill_chunk=3)
    assert s.report()["prefill_chunk"] == {"tokens": 3, "source": "--prefill-chunk"}


def test_expert_profile_read_once_and_strict_only_for_a_plan(models, tmp_path, monkeypatch):
    """One read of the expert profile feeds the cache and, with a hardware profile, the plan; the
    planner's strict checks (schema, sums) apply only then."""
    import hybrid.experts.popularity as popularity
    from hybrid.errors import HybridError

    prof = _profile(models["bf16"], tmp_path / "p.experts.json")
    reads = []
    read_json = popularity.read_json
    monkeypatch.setattr(popularity, "read_json", lambda p: reads.append(p) or read_json(p))
    kw = dict(gpus=(0, 1), layer_split=(1,), cache_slots=(8,), expert_profile=str(prof))
    s = open_session(models["bf16"], RuntimeOptions(profile="v100x2-e5v4", **kw))
    s.close()
    assert reads == [prof] and s.plan.inputs.experts_profile == str(prof)
    assert s.expert_profile.tokens == json.loads(prof.read_text())["tokens"]
    d = json.loads(prof.read_text())
    prof.write_text(json.dumps({k: v for k, v in d.items() if k != "schema"}))
    open_session(models["bf16"], RuntimeOptions(**kw)).close()                # no plan: lenient
    with pytest.raises(HybridError, match="expected schema 1"):
        open_session(models["bf16"], RuntimeOptions(profile="v100x2-e5v4", **kw))


def test_kv_resident_limit(models):
    from hybrid.errors import HybridError

    s = open_session(models["bf16"], RuntimeOptions(kv_resident=8, cache_slots=(0,)))
    with pytest.raises(HybridError, match="--kv-resident 8"):
        s.model.new_cache(9)
    s.close()


@pytest.mark.parametrize("kw,needle", [(dict(gpus=(0, 0), layer_split=(4,)), "--layer-split"),
                                       (dict(gpus=(0,), layer_split=(2,)), "--layer-split"),
                                       (dict(cache_slots=(-1,)), "--cache-slots"),
                                       (dict(pcie_frac=1.5), "--pcie-frac"),
                                       (dict(policy="static"), "expert profile")])
def test_bad_options_one_line(models, kw, needle):
    from hybrid.errors import HybridError

    with pytest.raises(HybridError, match=needle):
        open_session(models["bf16"], RuntimeOptions(**kw))


@pytest.mark.parametrize("slots", [(2 * EXPERTS, 2 * EXPERTS), (2 * EXPERTS, EXPERTS)])
def test_fully_resident_layers_skip_sync_and_replay(models, reference, tmp_path, slots):
    """Layers holding all their experts (warm start) take the sync-free path, lookups deferred to the
    step's end, mixed in one step with layers that miss; greedy ids and the trace replay are unchanged."""
    prof = _profile(models["nvfp4"], tmp_path / "p.experts.json")
    got, s = _run(models["nvfp4"], gpus=(0, 0), layer_split=(2,), cache_slots=slots, expert_profile=str(prof),
                  trace=str(tmp_path / "t.jsonl"))
    assert got == reference["nvfp4"]
    assert set(s.cards[0].full) == {0, 1}                                    # full from the first step
    assert (set(s.cards[1].full) == {2, 3}) == (slots[1] == 2 * EXPERTS)
    trace = read_trace(tmp_path / "t.jsonl")
    assert verify(trace) == []
    assert replay_run(trace).hit_rate == pytest.approx(s.report()["hit_rate"], abs=1e-6)
    assert s.report()["cards"][0]["hit_rate"] == 1.0


def test_hit_lists_meet_the_kernels_alignment(models, monkeypatch):
    """The hits' slot / token / weight rows go to the grouped kernel as views of one block copied up:
    each must start 16-byte aligned (the QPN launcher refuses others) and hold the same values as the
    lookup, whatever the hit count (odd counts included)."""
    from hybrid.runtime.slots import CardSlots

    seen = []
    real = CardSlots.moe_local

    def spy(self, layer, x, slot_ids, token_idx, route_w):
        seen.append(len(slot_ids))
        for t in (slot_ids, token_idx, route_w):
            assert t.is_contiguous() and t.data_ptr() % 16 == 0
        assert slot_ids.dtype == token_idx.dtype == torch.int32 and route_w.dtype == torch.float32
        return real(self, layer, x, slot_ids, token_idx, route_w)

    monkeypatch.setattr(CardSlots, "moe_local", spy)
    got, _ = _run(models["nvfp4"], cache_slots=(HALF,), prefill_chunk=3)
    assert any(n % 4 for n in seen) and got == _greedy(load_model(models["nvfp4"]), models["nvfp4"])

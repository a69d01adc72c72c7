"""ExpertCache bookkeeping and the cache policies: hand-made traces with known answers, budgets,
counters, the same-layer eviction rule, warm starts, profiles."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from hybrid.experts.cache import CacheError, ExpertCache, pcie_budget_bytes
from hybrid.experts.policy import (DecayedLFU, LRU, PolicyError, StaticPolicy, make_policy)
from hybrid.experts.popularity import (ExpertProfile, ProfileError, load_profile, profile_path,
                                       save_profile)
from hybrid.experts.trace import synthetic_trace


def run_sequence(cache: ExpertCache, seq, layer: int = 0):
    """Feed one expert (or a list) per step to one layer; return the per-step promotions."""
    out = []
    for ids in seq:
        cache.begin_step()
        _, done = cache.access(layer, np.atleast_1d(ids))
        out.append(done)
    return out


def classic_lfu() -> DecayedLFU:
    return DecayedLFU(half_life=float("inf"), margin=0.0)


def profile_of(counts) -> ExpertProfile:
    counts = np.asarray(counts)
    return ExpertProfile("toy", counts.shape[0], counts.shape[1], 2, 100, counts)


# ---- slot table and lookup ------------------------------------------------------------------

def test_slot_ids_are_contiguous_blocks_per_layer():
    cache = ExpertCache([4, 5, 6], [2, 3, 1], num_experts=8)
    assert [cache.slot_range(l) for l in (4, 5, 6)] == [range(0, 2), range(2, 5), range(5, 6)]
    assert cache.num_slots == 6
    cache.warm_start({5: [7, 1, 3, 6]})          # only 3 fit
    assert cache.residents(5) == {7: 2, 1: 3, 3: 4}
    assert cache.slot_of(5, 6) is None and cache.slot_table(5)[[7, 1, 3]].tolist() == [2, 3, 4]
    with pytest.raises(ValueError, match="layer 0 is not on this card"):
        cache.slot_of(0, 1)


def test_lookup_splits_hits_and_misses_per_token():
    cache = ExpertCache([0], 3, num_experts=8)
    cache.warm_start({0: [2, 5, 7]})
    cache.begin_step()
    lk = cache.lookup(0, [[5, 1], [1, 7], [2, 5]])    # [T=3, k=2]
    assert lk.slots.tolist() == [[1, -1], [-1, 2], [0, 1]]
    assert lk.hits == (2, 5, 7) and lk.misses == (1,) and lk.hit_slots == (0, 1, 2)
    # one request per expert per lookup, however many tokens use it
    assert cache.hits[0].tolist() == [0, 0, 1, 0, 0, 1, 0, 1]
    assert cache.misses[0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_lookup_needs_a_step_and_valid_ids():
    cache = ExpertCache([0], 2, num_experts=4)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.lookup(0, [1])
    cache.begin_step()
    with pytest.raises(ValueError, match="outside 0..3"):
        cache.lookup(0, [4])


def test_bad_configurations_are_user_errors():
    with pytest.raises(CacheError, match="slots per layer"):
        ExpertCache([0], 9, num_experts=8)
    with pytest.raises(CacheError, match="distinct"):
        ExpertCache([0, 0], 2, num_experts=8)
    with pytest.raises(CacheError, match="bytes_per_expert"):
        ExpertCache([0], 2, num_experts=8, budget_bytes=100)
    with pytest.raises(CacheError, match="pcie-frac"):
        pcie_budget_bytes(1.5, 12e9, 0.05)
    with pytest.raises(PolicyError, match="unknown cache policy"):
        make_policy("fifo")
    with pytest.raises(PolicyError, match="needs an expert-popularity profile"):
        make_policy("static")
    with pytest.raises(PolicyError, match="unknown parameter"):
        make_policy({"name": "lfu-decay", "halflife": 3})


def test_pcie_budget_bytes_is_frac_times_bandwidth_times_step():
    assert pcie_budget_bytes(0.25, 12e9, 0.040) == 120_000_000


# ---- known answers --------------------------------------------------------------------------

SEQ = [0, 1, 0, 2, 1, 0]


def test_lru_known_answer():
    cache = ExpertCache([0], 2, num_experts=4, policy=LRU())
    done = run_sequence(cache, SEQ)
    # [0] [0,1] hit0 | 2 evicts 1 | 1 evicts 0 | 0 evicts 2
    assert cache.hits[0].sum() == 1 and cache.misses[0].sum() == 5
    assert [(p.expert, p.evicted) for d in done for p in d] == [(0, None), (1, None), (2, 1),
                                                                 (1, 0), (0, 2)]
    assert cache.promotions[0].tolist() == [2, 2, 1, 0]
    assert cache.evictions[0].tolist() == [1, 1, 1, 0]


def test_classic_lfu_known_answer():
    cache = ExpertCache([0], 2, num_experts=4, policy=classic_lfu())
    run_sequence(cache, SEQ)
    # 2 (count 1) never beats 1 (count 1) strictly: 0 and 1 stay, hits at steps 2, 4, 5
    assert cache.hits[0].sum() == 3 and cache.residents(0) == {0: 0, 1: 1}
    assert cache.promotions[0].sum() == 2 and cache.evictions[0].sum() == 0


def test_decayed_score_is_a_sum_of_halvings():
    pol = DecayedLFU(half_life=1.0, margin=0.0)
    cache = ExpertCache([0], 1, num_experts=4, policy=pol)
    run_sequence(cache, [3, 1, 3])                # 3 at steps 0 and 2: 0.25 + 1
    assert pol.score(0, 3) == pytest.approx(1.25)
    assert pol.score(0, 1) == pytest.approx(0.5)


@pytest.mark.parametrize("margin, promotions", [(0.0, 10), (1.0, 1)])
def test_margin_stops_ping_pong(margin, promotions):
    cache = ExpertCache([0], 1, num_experts=4, policy=DecayedLFU(half_life=16, margin=margin))
    run_sequence(cache, [0, 1] * 5)
    assert cache.promotions[0].sum() == promotions


def test_margin_bounds_how_often_a_pair_swaps():
    margin = 3.0
    tr = synthetic_trace(4, 32, 4, 600, skew=0.6, drift=0.3, seed=3)
    cache = ExpertCache(range(4), 6, 32, DecayedLFU(half_life=8, margin=margin))
    last = {}
    swaps = 0
    for rec in tr.steps:
        cache.begin_step()
        for l in range(4):
            for p in cache.access(l, rec.ids[l])[1]:
                if p.evicted is None:
                    continue
                back = last.get((l, p.evicted, p.expert))   # when p.expert was pushed out by p.evicted
                if back is not None:
                    assert rec.step - back >= margin
                last[(l, p.expert, p.evicted)] = rec.step
                swaps += 1
    assert swaps > 20   # the trace does churn


# ---- the rules every policy obeys -----------------------------------------------------------

def test_current_layer_experts_are_never_evicted_by_its_own_promotions():
    cache = ExpertCache([0], 2, num_experts=8, policy=LRU())
    cache.warm_start({0: [0, 1]})
    cache.begin_step()
    lk, done = cache.access(0, [[0, 2, 3]])       # 0 hit (protected), 1 evictable, 2 and 3 missed
    assert [(p.expert, p.evicted) for p in done] == [(2, 1)]
    assert cache.slot_of(0, 0) == lk.hit_slots[0] == 0
    with pytest.raises(CacheError, match="no slot"):
        cache.promote(0, 3)                        # 0 and 2 are both in use this step


@pytest.mark.parametrize("policy", ["lru", "lfu-decay", {"name": "lfu-decay", "margin": 0}, "static"])
def test_hit_slots_survive_the_layers_promotions(policy):
    tr = synthetic_trace(3, 16, 4, 200, skew=0.8, drift=0.2, seed=5)
    pol = make_policy(policy, profile=tr.to_profile())
    cache = ExpertCache(range(3), 5, 16, pol)
    for rec in tr.steps:
        cache.begin_step()
        for l in range(3):
            lk, done = cache.access(l, rec.ids[l])
            used = set(lk.hits) | set(lk.misses)
            assert all(p.evicted not in used for p in done)
            assert all(cache.owner[s] == e for e, s in zip(lk.hits, lk.hit_slots))
            assert {p.expert for p in done} <= set(lk.misses)


def test_pcie_budget_is_honored():
    cache = ExpertCache(range(4), 8, 32, LRU(), bytes_per_expert=100, budget_bytes=250)
    tr = synthetic_trace(4, 32, 4, 50, skew=0.3, seed=1)
    per_step = []
    for i, rec in enumerate(tr.steps):
        cache.begin_step(budget_bytes=0 if i == 10 else None)    # one step gets no budget at all
        per_step.append(sum(len(cache.access(l, rec.ids[l])[1]) for l in range(4)))
    assert max(per_step) == 2 and per_step[0] == 2 and per_step[10] == 0
    st = cache.stats()
    assert st.max_step_bytes <= 250 and st.bytes_promoted == 100 * st.promotions.sum()
    cache.begin_step(budget_bytes=50)
    cache.lookup(0, [31])
    if cache.slot_of(0, 31) is None:
        with pytest.raises(CacheError, match="budget"):
            cache.promote(0, 31)


def test_unbounded_budget_fills_free_slots_at_once():
    cache = ExpertCache([0], 4, 16, LRU(), bytes_per_expert=100, budget_bytes=None)
    cache.begin_step()
    _, done = cache.access(0, [[1, 2, 3, 4, 5]])
    assert [p.slot for p in done] == [0, 1, 2, 3] and cache.stats().bytes_promoted == 400


@pytest.mark.parametrize("policy", ["lru", "lfu-decay"])
def test_counters_add_up(policy):
    tr = synthetic_trace(3, 16, 4, 300, skew=1.0, drift=0.1, seed=7)
    prof = tr.to_profile()
    cache = ExpertCache(range(3), [4, 6, 8], 16, make_policy(policy), bytes_per_expert=10,
                        budget_bytes=30)
    cache.warm_from_profile(prof)
    per_step_hits = 0
    for rec in tr.steps:
        cache.begin_step()
        per_step_hits += sum(len(cache.access(l, rec.ids[l])[0].hits) for l in range(3))
    st = cache.stats()
    for i, l in enumerate(range(3)):
        requests = sum(len(np.unique(r.ids[l])) for r in tr.steps)
        assert st.hits[i].sum() + st.misses[i].sum() == requests
        assert st.promotions[i].sum() - st.evictions[i].sum() == len(cache.residents(l)) - len(cache.warm[l])
        assert len(cache.residents(l)) == cache.capacities[i]
    assert st.hits.sum() == per_step_hits and st.steps == 300
    assert st.bytes_promoted == 10 * st.promotions.sum()
    assert sum(d["hits"] for d in st.to_dict()["layers"]) == st.hits.sum()
    assert 0 < st.hit_rate() < 1


def test_same_input_same_decisions():
    tr = synthetic_trace(2, 16, 2, 200, skew=0.0, seed=2)   # uniform: lots of ties
    runs = []
    for _ in range(2):
        cache = ExpertCache(range(2), 3, 16, make_policy("lfu-decay"))
        log = []
        for rec in tr.steps:
            cache.begin_step()
            for l in range(2):
                log += cache.access(l, rec.ids[l])[1]
        runs.append((log, cache.stats().to_dict()))
    assert runs[0] == runs[1]


def test_promote_forces_a_slot():
    cache = ExpertCache([0], 2, 8, LRU())
    cache.begin_step()
    assert cache.promote(0, 5) == (0, None)
    assert cache.promote(0, 6) == (1, None)
    assert cache.promote(0, 7) == (0, 5)          # LRU tie (never used): lowest id goes
    assert cache.promotions[0, 7] == 1 and cache.evictions[0, 5] == 1
    with pytest.raises(ValueError, match="already resident"):
        cache.promote(0, 7)


# ---- warm starts and profiles ---------------------------------------------------------------

def test_static_warm_start_places_the_top_experts_and_never_moves():
    counts = [[5, 50, 7, 40, 0, 40], [9, 8, 7, 6, 5, 4]]
    prof = profile_of(counts)
    cache = ExpertCache([0, 1], 3, 6, StaticPolicy(prof))
    cache.warm_from_profile(prof)
    assert set(cache.residents(0)) == {1, 3, 5} and set(cache.residents(1)) == {0, 1, 2}
    tr = synthetic_trace(2, 6, 2, 100, skew=0.0, seed=4)
    for rec in tr.steps:
        cache.begin_step()
        for l in range(2):
            cache.access(l, rec.ids[l])
    assert cache.promotions.sum() == 0
    assert cache.hits[0][[0, 2, 4]].sum() == 0 and cache.misses[0][[1, 3, 5]].sum() == 0


def test_static_cold_start_admits_only_members():
    prof = profile_of([[0, 9, 0, 8]])
    cache = ExpertCache([0], 2, 4, StaticPolicy(prof))
    done = run_sequence(cache, [0, 1, 2, 3, 0])
    assert [p.expert for d in done for p in d] == [1, 3]


def test_warm_lfu_is_seeded_with_the_steady_state_scores():
    prof = profile_of([[100, 50, 0, 0]])          # tokens=100: p = 1.0, 0.5
    pol = DecayedLFU(half_life=1.0, margin=0.0)   # g = 0.5: steady state p / (1 - g) = 2p
    cache = ExpertCache([0], 2, 4, pol)
    cache.warm_from_profile(prof)
    assert pol.score(0, 0) == 2.0 and pol.score(0, 1) == 1.0
    cache.begin_step()
    with pytest.raises(RuntimeError, match="after the first step"):
        cache.warm_from_profile(prof)


def test_describe_rebuilds_the_same_cache():
    prof = profile_of([[1, 2, 3, 4], [4, 3, 2, 1]])
    cache = ExpertCache([0, 1], 2, 4, DecayedLFU(half_life=5, margin=0.5), 7, 21)
    cache.warm_from_profile(prof)
    d = json.loads(json.dumps(cache.describe()))
    again = ExpertCache.from_description(d)
    assert again.describe() == cache.describe()
    assert np.array_equal(again.table, cache.table)
    assert np.array_equal(again.policy.scores[0], cache.policy.scores[0])


def test_profile_roundtrip_and_top(tmp_path):
    prof = profile_of([[3, 9, 9, 1], [0, 0, 5, 5]])
    path = save_profile(prof, profile_path("toy", tmp_path))
    assert path.name == "toy.experts.json"
    back = load_profile(path)
    assert back.to_dict() == prof.to_dict()
    assert back.top(0, 3) == [1, 2, 0] and back.top(1, 2) == [2, 3]
    assert back.probs(0).tolist() == [0.03, 0.09, 0.09, 0.01]


def test_one_loader_is_strict_for_a_model(tmp_path):
    from hybrid.model.config import ModelConfig
    from hybrid.planner import Popularity, load_popularity
    from hybrid.testing import random_config

    cfg = ModelConfig.from_dict(random_config("qwen3_moe", num_hidden_layers=2, num_experts=4,
                                              num_experts_per_tok=2))
    path = save_profile(profile_of([[3, 9, 7, 1], [0, 0, 10, 10]]), tmp_path / "t.experts.json")
    d = json.loads(path.read_text())
    d["tokens"] = 10
    path.write_text(json.dumps(d))
    assert load_profile(path).tokens == 10                               # no schema/kind: lenient only
    with pytest.raises(ProfileError, match="expected schema 1 and kind 'expert-popularity'"):
        load_profile(path, cfg)
    path.write_text(json.dumps({**d, "schema": 1, "kind": "expert-popularity"}))
    strict = load_profile(path, cfg)
    assert strict.to_dict() == load_profile(path).to_dict()
    pop = load_popularity(path, cfg)
    assert pop == Popularity.from_profile(strict, str(path))
    assert pop.shares == ((0.15, 0.45, 0.35, 0.05), (0.0, 0.0, 0.5, 0.5)) and pop.model == "toy"


def test_bad_profiles_are_user_errors(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.experts.json")
    bad = tmp_path / "bad.experts.json"
    bad.write_text(json.dumps({"model": "m", "num_layers": 2, "num_experts": 4, "top_k": 2,
                               "tokens": 3, "counts": [[1, 2, 3, 4]]}))
    with pytest.raises(ProfileError, match="shape"):
        load_profile(bad)
    bad.write_text(json.dumps({"model": "m"}))
    with pytest.raises(ProfileError, match="missing field"):
        load_profile(bad)


@pytest.mark.parametrize("policy", ["lfu-decay", "lru", "static"])
def test_lookup_resident_equals_one_lookup_per_layer(policy):
    """The batched lookup of fully resident layers (by ids, and by each layer's marked set of experts:
    lookup_used) leaves counters, policy state and the step's used sets exactly as one lookup per layer
    would: seeded scores, skipped steps (decay gaps), prefill-like steps whose tokens route to the same
    expert twice."""
    e, layers, rng = 16, [2, 5, 7, 9], np.random.default_rng(3)
    prof = profile_of(rng.integers(0, 50, size=(10, e)))

    def make():
        c = ExpertCache(layers, e, e, make_policy(policy, profile=prof))
        c.seed(prof)
        c.warm_start({l: list(range(e)) for l in layers})
        return c

    a, b, c = make(), make(), make()
    for step in range(40):
        a.begin_step(), b.begin_step(), c.begin_step()
        if step % 6 == 5:
            continue
        t = 1 if step % 3 else 5
        ids = rng.integers(0, e, size=(len(layers), t, 4))
        per = [a.lookup(l, ids[j]) for j, l in enumerate(layers)]
        used = b.lookup_resident(layers, ids)
        assert used == [list(lk.hits) for lk in per]
        mark = np.zeros((len(layers), e), dtype=bool)
        for j in range(len(layers)):
            mark[j, ids[j].ravel()] = True
        assert c.lookup_used(layers, mark) == used
    for x in (b, c):
        assert np.array_equal(a.hits, x.hits) and not x.misses.any() and a._used == x._used
        if policy == "lfu-decay":
            assert all(np.array_equal(a.policy.scores[l], x.policy.scores[l]) for l in layers)   # bit for bit
            assert a.policy.last == x.policy.last
        if policy == "lru":
            assert all(np.array_equal(a.policy.last_use[l], x.policy.last_use[l]) for l in layers)


def test_lookup_resident_refuses_a_miss_and_bad_input():
    c = ExpertCache([0, 1], [4, 8], 8)
    c.warm_start({0: [0, 1, 2, 3], 1: list(range(8))})
    with pytest.raises(RuntimeError, match="ExpertCache.lookup_resident before begin_step"):
        c.lookup_resident([0, 1], np.zeros((2, 1, 2)))
    with pytest.raises(RuntimeError, match="ExpertCache.lookup_used before begin_step"):
        c.lookup_used([0, 1], np.zeros((2, 8), dtype=bool))
    c.begin_step()
    with pytest.raises(RuntimeError, match="layer 0: expert 6 is not resident"):
        c.lookup_resident([0, 1], np.array([[[1, 6]], [[2, 3]]]))
    assert not c.hits.any()                                  # nothing counted
    with pytest.raises(ValueError, match="outside 0..7"):
        c.lookup_resident([0, 1], np.array([[[1, 8]], [[2, 3]]]))
    with pytest.raises(ValueError, match=r"lookup_resident: layers \[1, 1\] must be distinct"):
        c.lookup_resident([1, 1], np.zeros((2, 1, 2)))
    with pytest.raises(ValueError, match=r"lookup_used: layers \[1, 1\] must be distinct"):
        c.lookup_used([1, 1], np.zeros((2, 8), dtype=bool))
    with pytest.raises(ValueError, match=r"lookup_used: \(2, 4\) marks for 2 layers of 8 experts"):
        c.lookup_used([0, 1], np.zeros((2, 4), dtype=bool))
    assert c.lookup_resident([1, 0], np.array([[[7, 7]], [[3, 0]]])) == [[7], [0, 3]]
    assert c.hits[1, 7] == 1 and c.hits[0, [0, 3]].tolist() == [1, 1]

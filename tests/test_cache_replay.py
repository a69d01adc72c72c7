"""Routing traces, offline replay, Belady's bound, and the `hybrid-bench cache` what-if."""
from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest

from hybrid.bench import cache as bench_cache
from hybrid.cli.common import add_debug_flag, run_cli
from hybrid.experts.cache import ExpertCache
from hybrid.experts.policy import make_policy
from hybrid.experts.popularity import save_profile
from hybrid.experts.replay import belady, replay, replay_run, verify
from hybrid.experts.trace import (StepRecord, TraceError, TraceHeader, TraceWriter, read_trace,
                                  synthetic_trace, write_trace)

L, E, K = 6, 16, 4


def fake_run(path, policy: str, steps: int = 120, seed: int = 0):
    """What the runtime does: two cards, lookup then promote per layer, a trace with its hits."""
    routing = synthetic_trace(L, E, K, steps, skew=1.1, drift=0.2, seed=seed)
    profile = synthetic_trace(L, E, K, 200, skew=1.1, seed=seed).to_profile()
    cards = [ExpertCache(range(0, 3), 5, E, make_policy(policy, profile=profile), 1000, 2500),
             ExpertCache(range(3, L), [3, 4, 6], E, make_policy(policy, profile=profile), 1000, 3000)]
    for c in cards:
        c.warm_from_profile(profile)
    header = TraceHeader("toy", L, E, K, cards=[c.describe() for c in cards], meta={"cmd": "test"})
    owner = {l: c for c in cards for l in c.layers}
    with TraceWriter(path, header) as w:
        for rec in routing.steps:
            budgets = [None, 1000 * (rec.step % 4)]          # card 1's budget varies per step
            for c, b in zip(cards, budgets):
                c.begin_step(b)
            hits, promos = [], []
            for l in range(L):
                lk = owner[l].lookup(l, rec.ids[l])
                done = owner[l].promote_misses(l, lk)
                hits.append(len(lk.hits))
                promos.append(len(done))
            w.step(rec.ids, weights=np.full(rec.ids.shape, 0.25), budget_bytes=budgets,
                   hits=hits, promotions=promos, timings={"step_ms": 1.5})
    return cards


# ---- runtime == replay ----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["lfu-decay", "lru", "static"])
def test_runtime_hit_rates_equal_the_replay_of_its_trace(tmp_path, policy):
    path = tmp_path / "run.jsonl"
    cards = fake_run(path, policy)
    trace = read_trace(path)
    assert verify(trace) == []
    res = replay_run(trace)
    for run_card, replayed in zip(cards, res.caches):
        a, b = run_card.stats(), replayed.stats()
        for key in ("hits", "misses", "promotions", "evictions"):
            assert np.array_equal(getattr(a, key), getattr(b, key)), key
        assert a.hit_rate() == b.hit_rate() and a.bytes_promoted == b.bytes_promoted
        assert np.array_equal(run_card.table, replayed.table)
    if policy != "static":
        assert res.promotions.sum() > 0


def test_verify_reports_a_run_that_differs(tmp_path):
    path = tmp_path / "run.jsonl"
    fake_run(path, "lfu-decay", steps=30)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[5])
    rec["hits"][2] += 1
    lines[5] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    assert verify(read_trace(path)) == [f"step 4: run hits {rec['hits']} != replay "
                                        f"{[h - (i == 2) for i, h in enumerate(rec['hits'])]}"]


def test_replay_run_needs_the_runs_caches():
    with pytest.raises(TraceError, match="routing-only"):
        replay_run(synthetic_trace(2, 8, 2, 3))


def test_prefill_chunks_count_one_request_per_expert(tmp_path):
    tr = synthetic_trace(1, 8, 2, 2)
    tr.steps[0] = StepRecord(0, [[[1, 2], [2, 3], [1, 3]]], phase="prefill")   # T=3
    r = replay(read_trace(write_trace(tr, tmp_path / "t.jsonl")), "lru", 4)
    assert r.caches[0].misses.sum() + r.caches[0].hits.sum() == 3 + len(set(tr.steps[1].ids.ravel()))
    assert r.promotions[0].tolist() == [3]


# ---- Belady ---------------------------------------------------------------------------------

def brute_force_optimum(seq: list[set[int]], experts: int, slots: int) -> int:
    """Most hits any schedule gets: any start set; after each step keep what it used, add only
    experts it routed, hold at most `slots`."""
    states = [frozenset(c) for n in range(slots + 1) for c in itertools.combinations(range(experts), n)]
    value = {c: 0 for c in states}
    for req in reversed(seq):
        new = {}
        for c in states:
            keep, extra = c & req, (c | req) - (c & req)
            best = max(value[keep | frozenset(x)] for n in range(min(slots - len(keep), len(extra)) + 1)
                       for x in itertools.combinations(sorted(extra), n))
            new[c] = len(c & req) + best
        value = new
    return max(value.values())


@pytest.mark.parametrize("seed", range(40))
def test_belady_equals_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    experts, slots = int(rng.integers(3, 7)), int(rng.integers(1, 4))
    k, steps = int(rng.integers(1, min(3, experts) + 1)), int(rng.integers(3, 9))
    tr = synthetic_trace(1, experts, k, steps, skew=float(rng.uniform(0, 2)), seed=seed)
    seq = [set(s.ids[0].ravel().tolist()) for s in tr.steps]
    assert belady(tr, slots).hits.sum() == brute_force_optimum(seq, experts, slots)


def test_belady_breaks_next_use_ties_by_the_uses_after():
    # 0 and 4 are both next used at step 2; only 4 is used again: start with {2, 3, 4}
    seq = [[2, 3], [2, 3], [0, 4], [2, 3], [3, 4], [3, 4], [2, 3]]
    tr = synthetic_trace(1, 5, 2, len(seq))
    for rec, ids in zip(tr.steps, seq):
        rec.ids[0, 0] = ids
    r = belady(tr, 3)
    assert sorted(r.caches[0].warm[0]) == [2, 3, 4] and r.hits.sum() == 13


def test_belady_known_answer():
    seq = [0, 1, 2, 0, 1, 2]
    tr = synthetic_trace(1, 4, 1, 6)
    for rec, e in zip(tr.steps, seq):
        rec.ids[:] = e
    b, lru = belady(tr, 2), replay(tr, "lru", 2)
    assert b.hits.sum() == 4 and b.promotions.sum() == 0     # starts with {0, 1}, bypasses 2
    assert lru.hits.sum() == 0                                # cold LRU thrashes


@pytest.mark.parametrize("seed, skew, drift", [(0, 0.8, 0.0), (1, 1.2, 0.1), (2, 1.6, 0.3),
                                               (3, 0.3, 0.05), (4, 2.0, 0.5)])
def test_belady_bounds_every_policy(seed, skew, drift):
    tr = synthetic_trace(4, 24, 4, 150, skew=skew, drift=drift, seed=seed)
    prof = synthetic_trace(4, 24, 4, 150, skew=skew, seed=seed).to_profile()
    for slots in (2, 6, 12):
        best = belady(tr, slots).hits.sum(axis=0)                          # [L]
        rivals = [replay(tr, "lru", slots), replay(tr, "lfu-decay", slots),
                  replay(tr, {"name": "lfu-decay", "margin": 0}, slots, budget_experts=3),
                  replay(tr, "lfu-decay", slots, profile=prof, warm=True),
                  replay(tr, "static", slots, profile=prof, warm=True),
                  replay(tr, "static", slots, profile=tr.to_profile(), warm=True)]
        for r in rivals:
            assert (best >= r.hits.sum(axis=0)).all(), (r.name, slots)


def test_all_slots_means_all_hits_after_warm_up():
    tr = synthetic_trace(2, 8, 2, 50, seed=1)
    assert belady(tr, 8).hit_rate == 1.0
    r = replay(tr, "lru", 8)
    assert r.caches[0].misses.sum() == sum(len(np.unique(tr.requests(l)[0:50])) for l in range(2))


# ---- trace files ----------------------------------------------------------------------------

def test_trace_roundtrip(tmp_path):
    tr = synthetic_trace(3, 8, 2, 5, seed=1)
    tr.steps[2] = StepRecord(2, np.zeros((3, 4, 2), dtype=np.int64), np.full((3, 4, 2), 0.5),
                             phase="prefill", hits=[1, 2, 3], timings={"step_ms": 2.0})
    back = read_trace(write_trace(tr, tmp_path / "t.jsonl"))
    assert back.header == tr.header
    for a, b in zip(tr.steps, back.steps):
        assert np.array_equal(a.ids, b.ids) and a.phase == b.phase and a.hits == b.hits
        assert a.timings == b.timings
    assert back.steps[2].weights.tolist() == np.full((3, 4, 2), 0.5).tolist()
    assert back.to_profile().counts.sum(axis=1).tolist() == [2 * (4 + 4)] * 3


def set_first_id(lines, value):
    rec = json.loads(lines[1])
    rec["ids"][0][0][0] = value
    return lines[:1] + [json.dumps(rec)]


@pytest.mark.parametrize("mutate, message", [
    (lambda ls: ls[1:], "header line first"),
    (lambda ls: ls[:2] + ["{oops"], ":3: not JSON"),
    (lambda ls: ls[:1] + [ls[2]], "step 1 found where step 0"),
    (lambda ls: set_first_id(ls, 99), "outside 0..7"),
    (lambda ls: set_first_id(ls, [1, 2]), "bad step record"),
    (lambda ls: ls[:1] + [ls[1].replace('"ids":[[[', '"ids":[[[1,2]],[[')], "ids shape"),
])
def test_bad_traces_are_user_errors(tmp_path, mutate, message):
    path = write_trace(synthetic_trace(2, 8, 2, 3, seed=0), tmp_path / "t.jsonl")
    path.write_text("\n".join(mutate(path.read_text().splitlines())) + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_writer_checks_shapes_and_order(tmp_path):
    with TraceWriter(tmp_path / "t.jsonl", TraceHeader("m", 2, 8, 2)) as w:
        w.step([[1, 2], [3, 4]])                  # [L, k]: one token
        with pytest.raises(ValueError, match="expected"):
            w.step(np.zeros((3, 1, 2)))
        with pytest.raises(ValueError, match="expected step 1"):
            w.write(StepRecord(5, np.zeros((2, 1, 2))))
    assert read_trace(tmp_path / "t.jsonl").steps[0].ids.tolist() == [[[1, 2]], [[3, 4]]]


def test_synthetic_routing_is_skewed_and_reproducible():
    a, b = synthetic_trace(2, 32, 4, 400, skew=1.5, seed=9), synthetic_trace(2, 32, 4, 400, skew=1.5, seed=9)
    assert all(np.array_equal(x.ids, y.ids) for x, y in zip(a.steps, b.steps))
    counts = a.to_profile().counts
    assert all(len(set(s.ids[l, 0].tolist())) == 4 for s in a.steps for l in range(2))
    assert (np.sort(counts, axis=1)[:, -4:].sum(axis=1) > 0.5 * 400 * 4).all()   # top 4 get most


# ---- hybrid-bench cache ---------------------------------------------------------------------

def bench_main(argv) -> int:
    """`hybrid-bench cache ...` through the module contract (HELP, add_arguments, run)."""
    assert argv[0] == "cache" and bench_cache.HELP
    parser = argparse.ArgumentParser(prog="hybrid-bench cache")
    bench_cache.add_arguments(parser)
    add_debug_flag(parser)
    return run_cli(bench_cache.run, parser, argv[1:])


def test_bench_cache_json(tmp_path, capsys):
    path = write_trace(synthetic_trace(4, 16, 2, 80, skew=1.2, drift=0.1, seed=3), tmp_path / "t.jsonl")
    prof = save_profile(synthetic_trace(4, 16, 2, 80, skew=1.2, seed=3).to_profile(), tmp_path / "p.json")
    assert bench_main(["cache", "--trace", str(path), "--slots", "2,4,8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["results"]
    assert {r["policy"] for r in out} == {"lru", "lfu-decay", "ours", "belady"}   # no static: no profile
    assert bench_main(["cache", "--trace", str(path), "--slots", "2,4,8", "--profile", str(prof),
                       "--budget-experts", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["results"]
    for slots in (2, 4, 8):
        rows = {r["policy"]: r for r in out if r["slots"] == slots}
        assert set(rows) == {"lru", "lfu-decay", "static", "ours", "belady"}
        assert all(rows["belady"]["hit_rate"] >= r["hit_rate"] for r in rows.values())
        assert rows["static"]["promotions_per_step"] == 0
        assert all(r["promotions_per_step"] <= 2 for n, r in rows.items() if n != "belady")


def test_bench_cache_table_checks_a_run_trace(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    fake_run(path, "lfu-decay", steps=20)
    assert bench_main(["cache", "--trace", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run replay: matches the recorded hits"
    assert out[2].split() == ["slots", "lru", "lfu-decay", "ours", "belady"]
    assert [line.split()[0] for line in out[3:]] == ["4", "8", "16"]


def test_bench_cache_user_errors(tmp_path, capsys):
    path = write_trace(synthetic_trace(2, 8, 2, 5), tmp_path / "t.jsonl")
    assert bench_main(["cache", "--trace", str(path), "--slots", "4,x"]) == 2
    assert bench_main(["cache", "--trace", str(tmp_path / "none.jsonl")]) == 2
    prof = save_profile(synthetic_trace(3, 8, 2, 5).to_profile(), tmp_path / "p.json")
    assert bench_main(["cache", "--trace", str(path), "--profile", str(prof)]) == 2
    err = capsys.readouterr().err
    assert "--slots" in err and "cannot read trace" in err and "profile is 3 layers" in err

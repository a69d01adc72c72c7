"""The prefill offload threshold from the hardware profile (hybrid.planner.prefill): the cost model's
arithmetic against hand computation, its direction when one figure moves, the shipped profiles'
order, older profiles, the plan / CLI / RuntimeOptions wiring."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from hybrid.cli.plan import main as plan_main
from hybrid.model.config import ModelConfig
from hybrid.planner import ModelBytes, Plan, PlanRequest, Popularity, load_profile, make_plan
from hybrid.planner.memory import PREFILL_STAGE_GROUP, prefill_stage_bytes
from hybrid.planner.prefill import (CPU_LAYER_OPS, DEFAULT_M8_RATIO, STREAM_GROUP_OPS, STREAM_LAYER_OPS,
                                    _layers, call_cost, expected_call_cost, offload_min_tokens, step_cost)
from hybrid.planner.profile import Figure, profile_from_dict
from hybrid.runtime.options import PREFILL_OFFLOAD_MIN, RuntimeOptions

Q30 = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
       "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
       "norm_topk_prob": True, "tie_word_embeddings": False}
CHUNK = 4096


@pytest.fixture(scope="module")
def mb():
    return ModelBytes.from_config(ModelConfig.from_dict(Q30), "nvfp4")


def fig(v, source="assumed"):
    return Figure(v, source, "test")


def tuned(prof, h2d=None, cpu_gbs=None, r8=None, launch=None):
    """prof with every GPU's H2D / launch figure, or the CPU's kernel GB/s / M = 8 ratio, replaced."""
    gpus = tuple(replace(g, **({"h2d_gbs": fig(h2d)} if h2d else {}), **({"launch_us": fig(launch)} if launch else {}))
                 for g in prof.gpus)
    cpu = replace(prof.cpu, **({"nvfp4_kernel_gbs": fig(cpu_gbs)} if cpu_gbs else {}),
                  **({"nvfp4_m8_ratio": fig(r8)} if r8 else {}))
    return replace(prof, gpus=gpus, cpu=cpu)


def threshold(mb, prof, slots=0, chunk=CHUNK, pop=None) -> int:
    """The model's threshold for one card (GPU 0) holding `slots` experts, layer split none."""
    plan = make_plan(mb, prof, PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(slots,), prefill_chunk=chunk,
                                           prefill_stage=PREFILL_STAGE_GROUP), pop)
    return plan.prefill.model_min


def never_is_big(t: int) -> float:
    return math.inf if t == 0 else t


# ---------------------------------------------------------------- the arithmetic, by hand

def test_call_cost_hits_the_measured_points_and_is_linear():
    assert call_cost(1, 2.6) == pytest.approx(1.0) and call_cost(8, 2.6) == pytest.approx(2.6)
    assert call_cost(15, 2.6) == pytest.approx(1 + 1.6 / 7 * 14)
    assert call_cost(40, 1.0) == pytest.approx(1.0)                  # rows cost nothing extra
    assert call_cost(40, 0.5) == pytest.approx(1.0)                  # never below one M = 1 call


@pytest.mark.parametrize("tokens, p", [(1, 1 / 16), (7, 0.3), (64, 1 / 16), (300, 0.01)])
def test_expected_call_cost_equals_the_binomial_sum(tokens, p):
    r8 = 2.3
    m = np.arange(1, tokens + 1)
    pmf = np.array([math.comb(tokens, int(j)) * p**j * (1 - p) ** (tokens - j) for j in m])
    cost, touched = expected_call_cost(np.array([p]), tokens, r8)
    assert touched[0] == pytest.approx(pmf.sum(), rel=1e-9)
    assert cost[0] == pytest.approx((pmf * call_cost(m, r8)).sum(), rel=1e-9)


def test_step_cost_by_hand(mb):
    """One card, no slots, uniform routing: the module doc's formulas written out for T = 100."""
    prof = tuned(load_profile("v100x2-e5v4"), r8=1.5)
    plan = make_plan(mb, prof, PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(0,), prefill_chunk=CHUNK))
    L = _layers(mb, prof, plan.cards, None)
    T, E, k, H = 100, 128, 8, 2048
    got = step_cost(L, T, H, prof, 1.5)
    g, b = prof.gpus[0], mb.slot_bytes
    lam, s = g.launch_us.value, 0.5 / 7
    touched = 1 - (1 - k / E) ** T
    rows = T * k / E
    t1 = b / (prof.cpu.nvfp4_kernel_gbs.value * 1e9) * 1e6
    act = T * H * 4 / (g.d2h_gbs.value * 1e9) * 1e6 + T * H * 4 / (g.h2d_gbs.value * 1e9) * 1e6
    cpu = prof.overheads.cpu_dispatch_us.value + CPU_LAYER_OPS * lam + act + E * t1 * ((1 - s) * touched + s * rows)
    U = E * touched
    dma = U * b / (g.h2d_gbs.value * 1e9) * 1e6
    host = math.ceil(U / PREFILL_STAGE_GROUP) * STREAM_GROUP_OPS * lam
    stream = STREAM_LAYER_OPS * lam + max(dma, host) + PREFILL_STAGE_GROUP * b / g.kernel_bytes_per_s * 1e6
    assert got.layers == 48
    assert got.cpu_us == pytest.approx(48 * cpu, rel=1e-9)
    assert got.stream_us == pytest.approx(48 * stream, rel=1e-9)


def test_threshold_is_the_first_step_size_that_streams(mb):
    """The bisection's answer = a scan's: streaming loses one token below it and wins at it."""
    prof = load_profile("v100x2-e5v4")
    for r8 in (1.5, 2.0, 3.0):
        p = tuned(prof, r8=r8)
        plan = make_plan(mb, p, PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(256,), prefill_chunk=CHUNK))
        t, at = offload_min_tokens(mb, p, plan.cards, CHUNK)
        L = _layers(mb, p, plan.cards, None)
        assert 1 < t <= CHUNK and at.tokens == t and at.streams
        assert not step_cost(L, t - 1, 2048, p, r8).streams
        scan = next(n for n in range(1, CHUNK + 1) if step_cost(L, n, 2048, p, r8).streams)
        assert scan == t


# ---------------------------------------------------------------- direction of each figure

@pytest.mark.parametrize("figure,values", [("h2d", (8, 12, 25, 50)), ("cpu_gbs", (60, 35, 20, 10)),
                                           ("r8", (1.25, 1.6, 2.6, 4.0))],
                         ids=["faster_link", "slower_cpu", "costlier_rows"])
def test_each_figure_lowers_the_threshold(mb, figure, values):
    """A faster link, a slower CPU, costlier extra rows: each, alone, streams from fewer tokens."""
    prof = load_profile("v100x2-e5v4")
    ts = [never_is_big(threshold(mb, tuned(prof, **{figure: v}))) for v in values]
    assert ts == sorted(ts, reverse=True) and ts[0] > ts[-1]


def test_more_slots_fewer_missed_bytes(mb):
    """More slots: less to stream and less for the CPU at the same step size (uniform routing)."""
    prof = load_profile("v100x2-e5v4")
    costs = []
    for slots in (0, 1024, 2048, 4096):
        plan = make_plan(mb, prof, PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(slots,), prefill_chunk=CHUNK))
        L = _layers(mb, prof, plan.cards, None)
        missed = float((L.miss * L.b * L.weight[:, None]).sum())
        costs.append((missed, step_cost(L, 512, 2048, prof, 1.25)))
    assert [c[0] for c in costs] == sorted((c[0] for c in costs), reverse=True)
    assert costs[0][0] == 48 * 128 * mb.slot_bytes
    assert [c[1].stream_us for c in costs] == sorted((c[1].stream_us for c in costs), reverse=True)
    assert [c[1].cpu_us for c in costs] == sorted((c[1].cpu_us for c in costs), reverse=True)


def test_popular_experts_cached_leave_colder_misses(mb):
    """With an expert profile the card holds each layer's most chosen experts; what misses is routed
    fewer rows than under uniform routing, so the CPU keeps it longer (a higher threshold)."""
    prof = tuned(load_profile("v100x2-e5v4"), r8=2.0)
    w = np.arange(128, 0, -1, dtype=float) ** 2
    pop = Popularity("q30", tuple(tuple(w / w.sum()) for _ in range(48)), 1000)
    uni, skew = threshold(mb, prof, slots=1024), threshold(mb, prof, slots=1024, pop=pop)
    assert 0 < uni < skew


def test_shipped_profiles_order(mb):
    """The H200 box (PCIe 5, measured) streams from smaller prefill steps than the V100 rig (PCIe 3,
    assumed figures); both with every expert on the CPU."""
    h200, v100 = (never_is_big(threshold(mb, load_profile(n))) for n in ("h200", "v100x2-e5v4"))
    assert h200 < v100
    assert h200 < PREFILL_OFFLOAD_MIN                                # the old constant was the H200's guess


# ---------------------------------------------------------------- never, resident, reservation

def test_never_up_to_the_chunk_turns_it_off_and_gives_the_room_back(mb):
    slow = tuned(load_profile("v100x2-e5v4"), h2d=1.0)               # a 1 GB/s link never pays
    req = PlanRequest(gpus=(0,), kv_tokens=1024, prefill_chunk=512, prefill_stage=PREFILL_STAGE_GROUP,
                      cache_slots=(512,))
    auto = make_plan(mb, slow, req)
    forced = make_plan(mb, slow, replace(req, prefill_offload_min=256))
    assert auto.prefill.offload_min == auto.prefill.model_min == 0 and auto.prefill.at_tokens == 512
    assert auto.prefill.stream_us > auto.prefill.cpu_us
    assert forced.prefill.offload_min == 256 and forced.prefill.forced and forced.prefill.model_min == 0
    stage = prefill_stage_bytes(mb.slot_bytes, PREFILL_STAGE_GROUP)
    assert forced.cards[0].workspace_bytes - auto.cards[0].workspace_bytes == stage


def test_auto_that_streams_keeps_the_staging(mb):
    req = PlanRequest(gpus=(0,), kv_tokens=1024, prefill_chunk=512, prefill_stage=PREFILL_STAGE_GROUP,
                      cache_slots=(0,))
    plan = make_plan(mb, load_profile("h200"), req)
    bare = make_plan(mb, load_profile("h200"), replace(req, prefill_stage=0, prefill_offload_min=0))
    assert plan.prefill.offload_min > 0 and not plan.prefill.forced
    assert plan.cards[0].workspace_bytes - bare.cards[0].workspace_bytes == prefill_stage_bytes(
        mb.slot_bytes, PREFILL_STAGE_GROUP)


def test_all_resident_streams_nothing(mb):
    plan = make_plan(mb, load_profile("h200"), PlanRequest(gpus=(0,), kv_tokens=1024))
    assert plan.cards[0].slots == 48 * 128
    assert plan.prefill.layers == 0 and plan.prefill.offload_min == 0


def test_auto_split_computes_the_threshold_of_the_plan_it_returns(mb):
    prof = load_profile("v100x2-e5v4")
    req = PlanRequest(gpus=(0, 1), kv_tokens=1024, cache_slots=(1024,), prefill_chunk=CHUNK)
    auto = make_plan(mb, prof, req)
    fixed = make_plan(mb, prof, replace(req, layer_split=auto.inputs.layer_split))
    assert auto.prefill == fixed.prefill and auto.prefill.layers > 0


def test_cpu_only_plan_has_no_threshold(mb):
    assert make_plan(mb, load_profile("h200"), PlanRequest(gpus=(), kv_tokens=64)).prefill is None


def test_bad_request_value():
    from hybrid.errors import PlanError

    for bad in (-1, 2.5, True):
        with pytest.raises(PlanError, match="--prefill-offload-min"):
            PlanRequest(gpus=(0,), prefill_offload_min=bad)


# ---------------------------------------------------------------- profiles, plans, options, CLI

def test_older_profile_without_the_ratio_loads_and_uses_the_default(mb):
    d = json.loads(load_profile("h200").to_json())
    d["cpu"].pop("nvfp4_m8_ratio")
    old = profile_from_dict(d)
    assert old.cpu.nvfp4_m8_ratio is None and "nvfp4_m8_ratio" not in old.to_dict()["cpu"]
    plan = make_plan(mb, old, PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(0,)))
    assert plan.prefill.m8_source == "default" and plan.prefill.m8_ratio == DEFAULT_M8_RATIO
    new = profile_from_dict(json.loads(load_profile("h200").to_json()))
    assert new.cpu.nvfp4_m8_ratio.source == "measured" and profile_from_dict(new.to_dict()) == new


@pytest.mark.parametrize("name", ["h200", "h200x2", "v100x2-e5v4"])
def test_shipped_profiles_carry_the_ratio(name):
    r8 = load_profile(name).cpu.nvfp4_m8_ratio
    assert r8 is not None and 1.0 <= r8.value < 5.0 and r8.note
    if name == "v100x2-e5v4":
        assert r8.source == "assumed"


def test_bad_ratio_figure_is_refused():
    from hybrid.planner import ProfileError

    d = json.loads(load_profile("h200").to_json())
    d["cpu"]["nvfp4_m8_ratio"] = {"value": 0, "source": "assumed", "note": "x"}
    with pytest.raises(ProfileError, match=r"profile.cpu.nvfp4_m8_ratio: value must be a positive"):
        profile_from_dict(d)


def test_plan_json_round_trip_with_and_without_prefill(mb):
    plan = make_plan(mb, load_profile("h200"), PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(0,)))
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.prefill == plan.prefill
    d = json.loads(plan.to_json())
    d.pop("prefill")                                                # a plan written before the field
    assert Plan.from_dict(d).prefill is None


def test_options_offload_min_for(mb):
    plan = make_plan(mb, load_profile("h200"), PlanRequest(gpus=(0,), kv_tokens=1024, cache_slots=(0,)))
    t = plan.prefill.offload_min
    assert RuntimeOptions(device="cuda").offload_min_for(plan) == t
    assert RuntimeOptions(device="cuda", prefill_offload_min=300).offload_min_for(plan) == 300   # the flag wins
    assert RuntimeOptions(device="cuda", prefill_offload_min=0).offload_min_for(plan) == 0
    assert RuntimeOptions(device="cuda").offload_min_for(None) == PREFILL_OFFLOAD_MIN              # no profile
    assert RuntimeOptions().offload_min_for(plan) == 0                                             # CPU mode
    assert RuntimeOptions(prefill_offload_min=5).offload_min_for(plan) == 5


@pytest.fixture(scope="module")
def q30_dir(tmp_path_factory):
    from hybrid.testing import random_config

    folder = tmp_path_factory.mktemp("q30")
    cfg = random_config("qwen3_moe", **{k: v for k, v in Q30.items() if k != "model_type"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_cli_prints_the_threshold_and_why(q30_dir, capsys):
    base = ["--model", str(q30_dir), "--profile", "v100x2-e5v4", "--cache-slots", "0", "--prefill-chunk", "4096"]
    assert plan_main(base) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("prefill offload:"))
    t = int(line.split(">= ")[1].split()[0])
    assert "(cost model; --prefill-offload-min auto)" in line
    assert f"at {t} tokens a layer that can miss streams its misses in" in out and "(assumed)" in out
    assert plan_main(base + ["--prefill-offload-min", "64"]) == 0
    out = capsys.readouterr().out
    assert "prefill offload: steps of >= 64 tokens stream (--prefill-offload-min 64)" in out
    assert f"the cost model's threshold: from {t} tokens" in out
    assert plan_main(base + ["--prefill-offload-min", "0"]) == 0
    assert "prefill offload: off (--prefill-offload-min 0)" in capsys.readouterr().out
    assert plan_main(base + ["--prefill-chunk", "256"]) == 0           # below the crossover: never
    out = capsys.readouterr().out
    assert "prefill offload: off, no staging reserved" in out and "never up to the 256-token prefill chunk" in out
    assert plan_main(base + ["--prefill-offload-min", "ten"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prefill-offload-min ten: expected auto or a token count >= 0") and err.count("\n") == 1

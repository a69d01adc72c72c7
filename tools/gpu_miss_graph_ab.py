"""A/B of a can-miss layer's hits inside its decode graph (HYBRID_MISS_GRAPH=1) against the old path
(HYBRID_MISS_GRAPH=0: hits launched eagerly after the host sync), in one process, on the
Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint. Writes $OUT/miss_graph_ab.jsonl + gpu_check.log.

One expert store and one expert profile (an all-CPU session routes a calibration text, as
tools/gpu_two_cards.py does) serve every session; for each configuration label the sessions run in
the order of --modes (default 0,1,0,1: a VM that drifts during the call hits both paths alike). Per
session: decode tok/s (CUDA graphs), per-card hit rates, the planner's prediction, the first greedy
ids (equal across modes?), the linked layers, and the host's CUDA calls per decode step
(torch.profiler over a few steps after the measurement: graph launches, copies, kernel launches,
event records / waits / syncs) and the GPU time per step by kernel (cuda_calls_per_step.gpu).

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_miss_graph_ab.py \\
        --profile h200 --order synth_one_gpu_slots1024 --modes 0,1,0,1 --budget-s 420

--env NAME A/Bs another switch the same way, e.g. the router's MoE routing (hybrid.kernels.fused "plan"):
    --env HYBRID_FUSED_NEW --modes "all;norm,router,attn;all;norm,router,attn"
or the QPN weight stream's L2 evict-first hint (sm_80+; the QPN module is built again per session):
    --env HYBRID_QPN_L2 --modes "normal;evict_first;normal;evict_first"
and several switches at once, VAR1+VAR2 with each mode's values joined the same way:
    --env HYBRID_PDL+HYBRID_SMEM_CARVEOUT --modes "1+100;1+-1;0+100"
A name opt:<field> sets a string-valued RuntimeOptions field instead of a variable (the mode's text as it is, so not
a numeric or tuple field), e.g. the head's storage (hybrid-run --lm-head):
    --env opt:lm_head --modes "keep;nvfp4;fp8;keep;nvfp4;fp8"
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_runtime_check as rc  # noqa: E402  - log / make_synth / calibrate_profile / graph_info / run_parts
import gpu_two_cards as tc  # noqa: E402  - configs(miss_slots, order): the labels and their flags

rc.OUT = tc.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "miss_graph_ab.jsonl"
CUDA_CALLS = ("cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaLaunchKernel",
              "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaEventRecord",
              "cudaEventRecordWithFlags", "cudaStreamWaitEvent", "cudaEventSynchronize", "cudaStreamSynchronize")


record = rc.recorder("tools/gpu_miss_graph_ab.py", JSONL,
                     ("env", "decode_tok_s", "measured_over_predicted", "cuda_calls_per_step",
                      "ids_equal_first", "skipped", "error"))


rc.record = tc.record = record


def warm_decode(session, steps: int):
    """A fresh cache for `steps` profiled decode steps after 4 warm-up ones (their graphs captured
    before profiling); -> (the session's model, the last warm-up logits). Reset prompt_tokens after."""
    import torch

    hm = session.model
    hm.new_cache(steps + 8)
    hm.prompt_tokens = 1
    logits = hm.forward(torch.tensor([100]), 0, last_only=True)
    for j in range(1, 4):
        logits = hm.forward(torch.tensor([int(logits[-1].argmax())]), j, last_only=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return hm, logits


def cuda_calls(session, steps: int = 8) -> dict:
    """The host's CUDA runtime / driver calls per graphed decode step (torch.profiler), by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hm, logits = warm_decode(session, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for j in range(4, 4 + steps):
            logits = hm.forward(torch.tensor([int(logits[-1].argmax())]), j, last_only=True)
        torch.cuda.synchronize()
    hm.prompt_tokens = None
    avg = prof.key_averages()
    counts = {e.key: round(e.count / steps, 2) for e in avg if e.key in CUDA_CALLS}
    return {"per_step": round(sum(counts.values()), 2), "by_name": counts, "gpu": kernel_times(avg, steps),
            "wall": wall_times(prof.events(), steps)}


def wall_times(events, steps: int, top: int = 20) -> dict:
    """Where the GPU's wall time of the profiled steps goes, kernels overlapping (dependent launches): the
    GPU kernels / copies by start time, each charged the time by which it moves the latest end so far
    ("exposed": a kernel wholly inside another's span is charged nothing), the time with nothing running
    ("idle"), and per name the mean start of a kernel after the previous one's end ("start_after_prev":
    negative = overlapped). Per step: [name, exposed us, count]."""
    ks = sorted(((e.time_range.start, e.time_range.end, e.name[:60]) for e in events
                 if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start))
    if not ks:
        return {}
    exposed: dict[str, float] = {}
    count: dict[str, int] = {}
    after: dict[str, list[float]] = {}
    idle, last_end, prev_end = 0.0, ks[0][0], ks[0][0]
    for start, end, name in ks:
        idle += max(0.0, start - last_end)
        exposed[name] = exposed.get(name, 0.0) + max(0.0, end - max(last_end, start))
        count[name] = count.get(name, 0) + 1
        after.setdefault(name, []).append(start - prev_end)
        last_end, prev_end = max(last_end, end), end
    rows = sorted(exposed.items(), key=lambda kv: -kv[1])[:top]
    return {"span_us": round((last_end - ks[0][0]) / steps, 1), "idle_us": round(idle / steps, 1),
            "exposed": [[n, round(us / steps, 2), round(count[n] / steps, 2)] for n, us in rows],
            "start_after_prev": {n: round(sum(v) / len(v), 2) for n, v in after.items() if count[n] >= steps}}


def host_profile(session, steps: int = 32, top: int = 30) -> dict:
    """Where the host's time of a graphed decode step goes (cProfile over `steps` steps of
    hybrid.generate's loop body: forward, argmax, token): wall ms per step and the `top`
    functions by own time as [file:line(name), us per step, calls per step]."""
    import cProfile

    import torch

    hm, logits = warm_decode(session, steps)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for j in range(4, 4 + steps):
        logits = hm.forward(torch.tensor([int(logits[-1].argmax())]), j, last_only=True)
    int(logits[-1].argmax())
    prof.disable()
    wall = time.perf_counter() - t0
    hm.prompt_tokens = None
    return {"wall_ms_per_step": round(wall / steps * 1e3, 3), "top": rc.top_functions(prof, steps, top)}


def generate_profile(session, tok, tokens: int = 40, top: int = 30) -> dict:
    """Where the host's time of hybrid.generate's overlapped decode goes (cProfile over one greedy
    generation of `tokens` tokens after the session's warm-up): wall ms per decoded token and the
    `top` functions by own time per token. Time inside the event / read waits is the host waiting
    for the GPU (GPU-bound); little of it means the host sets the pace."""
    import cProfile

    from hybrid.bench.decode import prompt_ids
    from hybrid.generate import generate
    from hybrid.sampler import Sampler, SamplerConfig

    ids = prompt_ids(tok, 32)
    session.model.prompt_tokens = len(ids)
    greedy = Sampler(SamplerConfig())
    generate(session.model, tok, ids, 8, greedy, prefill_chunk=session.prefill_chunk)
    prof = cProfile.Profile()
    prof.enable()
    res = generate(session.model, tok, ids, tokens, greedy, prefill_chunk=session.prefill_chunk)
    prof.disable()
    n = max(len(res.generated_ids) - 1, 1)
    return {"decode_tok_s": round(res.decode_tok_s, 2), "tokens": len(res.generated_ids),
            "top": rc.top_functions(prof, n, top)}


def generate_wall(session, tok, tokens: tuple[int, int] = (16, 56), prompt: int = 32) -> dict:
    """The GPU's wall time (wall_times) per decoded token of hybrid.generate's overlapped decode, as hybrid-run runs
    it: two greedy generations of the same prompt, tokens[0] and tokens[1] tokens, under torch.profiler (CUDA
    activity only), and the difference of their figures over the difference of their token counts (the prefill
    and the first steps cancel out). decode_tok_s: the longer generation's own, under the profiler. prompt: its
    tokens (the attention's keys)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybrid.bench.decode import prompt_ids
    from hybrid.generate import generate
    from hybrid.sampler import Sampler, SamplerConfig

    ids = prompt_ids(tok, prompt)
    session.model.prompt_tokens = len(ids)
    greedy = Sampler(SamplerConfig())
    generate(session.model, tok, ids, 8, greedy, prefill_chunk=session.prefill_chunk)
    got = []
    for n in tokens:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = generate(session.model, tok, ids, n, greedy, prefill_chunk=session.prefill_chunk)
            torch.cuda.synchronize()
        got.append((len(res.generated_ids), res.decode_tok_s, wall_times(prof.events(), 1, top=40)))
    (n0, _, w0), (n1, tps, w1) = got
    if n1 <= n0 or not w0 or not w1:
        return {"tokens": [n0, n1], "error": "the generations stopped early"}
    d = n1 - n0
    e0 = {k: v for k, v, _ in w0["exposed"]}
    return {"decode_tok_s": round(tps, 2), "tokens": [n0, n1],
            "span_us": round((w1["span_us"] - w0["span_us"]) / d, 1),
            "idle_us": round((w1["idle_us"] - w0["idle_us"]) / d, 1),
            "exposed": [[k, round((v - e0.get(k, 0.0)) / d, 2)] for k, v, _ in w1["exposed"][:20]]}


def kernel_times(avg, steps: int, top: int = 25) -> dict:
    """GPU time per decode step by kernel / copy (CUPTI records the kernels of graph replays too):
    the total and the largest `top` entries as [name, us per step, launches per step]."""
    rows = []
    for e in avg:
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and e.device_type.name == "CUDA":
            rows.append((e.key[:90], us / steps, e.count / steps))
    rows.sort(key=lambda r: -r[1])
    return {"us_per_step": round(sum(r[1] for r in rows), 1),
            "top": [[n, round(us, 2), round(c, 2)] for n, us, c in rows[:top]]}


def mode_env(env: str, mode: str) -> dict[str, str]:
    """--env / one --modes entry -> the switches a session sets: one name (the whole mode its value, plus signs
    included) or several, VAR1+VAR2 with values v1+v2."""
    names = env.split("+")
    values = mode.split("+") if len(names) > 1 else [mode]
    if len(names) != len(values) or not all(names):
        raise SystemExit(f"--modes: {mode!r} has {len(values)} values for the {len(names)} switches of --env {env}")
    return dict(zip(names, values))


def runs(path: Path, deadline: float, tokens: int, profile: str, miss_slots: int, order: str, modes: list[str],
         host_prof: bool = False, env: str = "HYBRID_MISS_GRAPH", prompts: tuple[int, ...] = (32,)) -> None:
    import torch

    from hybrid.bench.decode import measure
    from hybrid.kernels import build
    from hybrid.runtime import RuntimeOptions, open_session

    cfg, tok, ctx, cpu, eprof = tc.expert_profile_session(path, profile, tokens)
    ctx = max(ctx, max(prompts) + max(tokens, 56) + 16)    # the sessions' KV rows: the prompt and the generations
    first: dict = {}
    for (label, kw), prompt, mode in itertools.product(tc.configs(miss_slots, order), prompts, modes):
        check = f"{label}_miss_graph{mode}" if env == "HYBRID_MISS_GRAPH" else f"{label}_{env}={mode}"
        if len(prompts) > 1:
            check += f"_prompt{prompt}"
        if time.perf_counter() > deadline:
            record({"check": check, "skipped": "device-time deadline"})
            continue
        switches = mode_env(env, mode)
        fields = {k[4:]: v for k, v in switches.items() if k.startswith("opt:")}   # RuntimeOptions fields
        os.environ.update({k: v for k, v in switches.items() if not k.startswith("opt:")})  # read at capture
        if build.L2_ENV in switches:              # read when the QPN module is built: build it again
            build.forget_modules()
        rc.log(f"session {check}: {kw}")
        gc.collect()                              # the previous session's last references (records, frames)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()   # so vram_gib.peak is this session's
        s = open_session(path, RuntimeOptions(device="cuda", profile=profile, expert_profile=str(eprof),
                                              **{**kw, **fields}), context=ctx, cpu=cpu)
        try:
            rec = measure(s, tok, prompt, 16, tokens)
            g = s.model.graphs
            rec.update({"env": switches, "flags": kw, "linked_layers": len(g.links), "prompt_tokens": prompt,
                        "plan_split": list(s.plan.inputs.layer_split), **rc.graph_info(s)})
            rec["cuda_calls_per_step"] = cuda_calls(s)
            rec["generate_wall"] = generate_wall(s, tok, prompt=prompt)
            rec["vram_gib"] = {"allocated": round(torch.cuda.memory_allocated() / 2**30, 3),    # the session's, on GPU 0
                               "peak": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
            if host_prof:
                rec["host_profile"] = host_profile(s)
                rec["generate_profile"] = generate_profile(s, tok)
            head = rec["generated_ids_head"]
            rec["ids_equal_first"] = first.setdefault((label, prompt), head) == head
            record({"check": check, **rec})
        finally:
            s.close()
            del s
            torch.cuda.empty_cache()
    cpu.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[32],
                   help="prompt lengths of the measured generations (each with every mode, in this order)")
    p.add_argument("--budget-s", type=float, default=420, help="stop starting new sessions after this")
    p.add_argument("--miss-slots", type=int, default=1024, help="expert slots per card of the sessions with misses")
    p.add_argument("--profile", default="h200", help="hardware profile the plans use")
    p.add_argument("--order", default="synth_one_gpu_slots1024", help="configuration labels (gpu_two_cards.configs)")
    p.add_argument("--modes", default="0,1,0,1",
                   help="values of --env, in order, per label (separated by ';' where a value holds commas)")
    p.add_argument("--env", default="HYBRID_MISS_GRAPH",
                   help="the environment switch the sessions differ in (several: VAR1+VAR2, each mode v1+v2)")
    p.add_argument("--host-profile", action="store_true", help="also cProfile 32 graphed decode steps per session")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = rc.T0 + a.budget_s
    modes = [m.strip() for m in a.modes.split(";" if ";" in a.modes else ",") if m.strip()]
    if not modes or (a.env == "HYBRID_MISS_GRAPH" and any(m not in ("0", "1") for m in modes)):
        print(f"--modes {a.modes}: expected a comma-separated list of 0 and 1", file=sys.stderr)
        return 2
    parts = [("synth_write", lambda: rc.make_synth(a.synth, a.skew, False)),
             ("ab_runs", lambda: runs(a.synth, deadline, a.tokens, a.profile, a.miss_slots, a.order, modes,
                                        a.host_profile, a.env, tuple(a.prompt_tokens)))]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

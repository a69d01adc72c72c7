"""Where an all-CPU decode token's time goes (every expert on the CPU runner, or --slots of them cached
on the card; the layers graphed and linked: hybrid.runtime.graphs / miss_link), and A/B of how a
linked layer hands its misses to the runner, in one session on the Qwen3-30B-A3B-shaped synthetic
NVFP4 checkpoint. Writes $OUT/cpu_decode_ab.jsonl + gpu_check.log.

Variants (applied to the one session's runner between generations, in the order given, repeats allowed):
    pool      submit + sync through the runner's pool thread (HYBRID_CPU_DIRECT=0)
    direct    runner.run on the calling thread (the default)
    join      pool, and sync() runs unclaimed units on the calling thread (HYBRID_CPU_JOIN=1)
    <v>@<n>   the same with n parts per call (runner.threads), e.g. direct@15
    <v>+store the same with expert-cache promotions read from the pinned CPU store
              (HYBRID_PROMOTE_SOURCE=store; without the suffix: checkpoint), e.g. direct+store
Per generation: decode tok/s, ms per token, and per token the wall time of each host phase of the
linked layers (timers around the functions, same in every variant): replay (segment graph launch),
fetch (the wait for the routed row's event + its read), lookup (expert cache), cpu (the runner call;
the prompt step's pooled calls are spread over the decode steps), put (the CPU sum to pinned memory),
book (promote + account), the whole DecodeGraphs.step, and the rest of
the loop (head, sampling, detokenization); with the runner's own counters (pool: queue and kernel
time; direct: the call's time).

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_cpu_decode_ab.py \\
        --variants pool,direct,pool,direct,join,direct@15 --tokens 48 --budget-s 300

--small: a 4-layer toy checkpoint instead; --device cpu: the same on a machine without a GPU (smoke).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode_overlap_ab as oa  # noqa: E402  - synth_args / synth_parts, uniform_profile
import gpu_runtime_check as rc  # noqa: E402  - log / recorder / run_parts
from hybrid.runtime.store_stage import PROMOTE_ENV  # noqa: E402

rc.OUT = oa.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "cpu_decode_ab.jsonl"
record = rc.recorder("tools/gpu_cpu_decode_ab.py", JSONL,
                     ("variant", "decode_tok_s", "ms_per_token", "phases_ms_per_token", "runner", "ids_equal_first",
                      "skipped", "error"))
rc.record = oa.record = record
VARIANTS = ("pool", "direct", "join")


class PhaseTimer:
    """Wraps methods (on their classes) so each call's wall time adds to a named phase."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self._undo: list = []

    def wrap(self, cls, name: str, phase: str) -> None:
        f = getattr(cls, name)
        acc = self.s

        @functools.wraps(f)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)
        self._undo.append((cls, name, f))

    def reset(self) -> None:
        self.s.clear()

    def close(self) -> None:
        for cls, name, f in reversed(self._undo):
            setattr(cls, name, f)


def parse_variant(v: str) -> tuple[str, int | None, str]:
    """'<base>[@<parts>][+store]' -> (base, parts or None, promotion source)."""
    rest, plus, src = v.partition("+")
    base, _, n = rest.partition("@")
    if base not in VARIANTS or (n and not n.isdigit()) or (plus and src != "store"):
        raise SystemExit(f"--variants: {v!r}: expected one of {', '.join(VARIANTS)}, optionally @<parts> and +store")
    return base, int(n) if n else None, "store" if plus else "checkpoint"


def apply(s, base: str, parts: int | None, threads0: int, promote: str = "checkpoint") -> None:
    """Set the session's hand-off variant and promotion source (see the module doc)."""
    os.environ[PROMOTE_ENV] = promote
    ex = s.model.experts
    runner = ex.cpu.runner
    ex.cpu_direct = base == "direct"
    runner.threads = parts or threads0
    if base == "join" and not runner.join:
        runner.join = True
        runner._warm_up()                             # compiles (or loads) the joining path once
    elif base != "join":
        runner.join = False


def runs(path: Path, deadline: float, a) -> None:
    from hybrid.bench.decode import prompt_ids
    from hybrid.experts.cache import ExpertCache
    from hybrid.generate import generate
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions, open_session
    from hybrid.runtime.graphs import DecodeGraphs, _Runner
    from hybrid.runtime.hybrid_experts import HybridExperts
    from hybrid.runtime.miss_link import MissLink
    from hybrid.runtime.monitor import snapshot, window
    from hybrid.sampler import Sampler, SamplerConfig
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    eprof = None if a.even_slots else oa.uniform_profile(path)
    ids = prompt_ids(tok, 32)
    opts = RuntimeOptions(device=a.device, gpus=(0,), cache_slots=(a.slots,), profile=a.profile if a.device == "cuda" else None,
                          expert_profile=eprof and str(eprof), cpu_threads=a.threads)
    rc.log(f"session: {a.slots} expert slots, the rest on the CPU runner ({opts})")
    s = open_session(path, opts, context=len(ids) + a.tokens + a.warmup + 8)
    timer = PhaseTimer()
    try:
        runner = s.model.experts.cpu.runner
        threads0 = runner.threads
        if a.device == "cpu":                 # smoke: the graphed path's pieces run eagerly, every call pooled
            s.model.graphs = DecodeGraphs(s.model.model, s.model.experts, capture=False, enabled=True)
            runner.inline_bytes = 0
        record({"check": "session", "slots": a.slots, "threads": threads0, "pool_wait": runner.wait, "schedule": runner.schedule,
                "load_s": {k: round(v, 2) for k, v in s.load_s.items()}, "placement": s.placement.describe()})
        for cls, name, phase in ((_Runner, "run", "replay"), (MissLink, "fetch", "fetch"),
                                 (ExpertCache, "lookup", "lookup"), (MissLink, "put", "put"),
                                 (HybridExperts, "_promote", "book"), (HybridExperts, "_account", "book"),
                                 (DecodeGraphs, "step", "step"), (HybridExperts, "linked", "linked")):
            timer.wrap(cls, name, phase)
        for name in ("run", "sync", "submit"):
            timer.wrap(type(s.model.experts.cpu), name, "cpu")
        predicted = round(s.plan.prediction.tok_s, 2) if s.plan is not None else None
        greedy = Sampler(SamplerConfig())
        s.model.prompt_tokens = len(ids)
        generate(s.model, tok, ids, a.warmup, greedy, prefill_chunk=s.prefill_chunk)        # graphs, compiles
        first = None
        for v in a.variants.split(","):
            if time.perf_counter() > deadline:
                record({"check": f"variant_{v}", "variant": v, "skipped": "device-time deadline"})
                continue
            base, parts, promote = parse_variant(v)
            apply(s, base, parts, threads0, promote)
            tm0, n0, snap = dict(runner.timing), s.stats.steps["decode"], snapshot(s)
            timer.reset()
            res = generate(s.model, tok, ids, a.tokens, greedy, prefill_chunk=s.prefill_chunk)
            steps = s.stats.steps["decode"] - n0
            n = max(steps, 1)
            # the prompt's step is in the window too: its phases are divided over the decode steps
            phases = {k: round(t / n * 1e3, 3) for k, t in sorted(timer.s.items())}
            ms = 1e3 / res.decode_tok_s if res.decode_tok_s else None
            if ms is not None:
                phases["loop_rest"] = round(ms - phases.get("step", 0.0), 3)
            tm = {k: round(runner.timing[k] - tm0[k], 6) for k in tm0}
            runner_ms = {"pool_calls": tm["calls"], "queue_ms_per_token": round(tm["queue_s"] / n * 1e3, 3),
                         "kernel_ms_per_token": round(tm["kernel_s"] / n * 1e3, 3),
                         "direct_calls": tm["direct_calls"], "direct_ms_per_token": round(tm["direct_s"] / n * 1e3, 3)}
            first = first or res.generated_ids
            diff = next((i for i, (x, y) in enumerate(zip(first, res.generated_ids)) if x != y), None)
            record({"check": f"variant_{v}", "variant": v, "slots": a.slots, "parts": runner.threads, "decode_steps": steps,
                    "promote_source": promote,
                    "decode_tok_s": round(res.decode_tok_s, 3), "ms_per_token": round(ms, 3) if ms else None,
                    "phases_ms_per_token": phases, "runner": runner_ms,
                    "ids_equal_first": res.generated_ids == first, "first_diff": diff,
                    "generated_ids": res.generated_ids, "predicted_tok_s": predicted,
                    **window(s, snap, snapshot(s), steps)})
        apply(s, "direct", None, threads0)
    finally:
        timer.close()
        s.close()


def main() -> int:
    p = argparse.ArgumentParser()
    oa.synth_args(p)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the tool here")
    p.add_argument("--profile", default="h200")
    p.add_argument("--threads", type=int, default=None, help="--cpu-threads of the session (default: physical cores)")
    p.add_argument("--slots", type=int, default=0, help="expert cache slots on the card (uniform profile: "
                   "a warm start fills them; 0 = every expert on the CPU)")
    p.add_argument("--even-slots", action="store_true", help="no expert profile: the slots spread evenly over the "
                   "layers, filled by promotions during decode (a cache that promotes; with the uniform profile "
                   "whole layers are resident and nothing promotes)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--variants", default="pool,direct,pool,direct")
    p.add_argument("--budget-s", type=float, default=300, help="stop starting new generations after this")
    a = p.parse_args()
    for v in a.variants.split(","):
        parse_variant(v)
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = rc.T0 + a.budget_s
    parts = oa.synth_parts(a) + [("ab_runs", lambda: runs(a.synth, deadline, a))]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefill offload A/B (hybrid.runtime.prefill_stream) on the Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint,
in one process. Writes $OUT/prefill_stream.jsonl + gpu_check.log.

1. The GPU tests of prefill offload (tests/test_prefill_stream_cuda.py, with its printed tiny-model tok/s).
2. The synthetic checkpoint (tools/make_synthetic.py) and an all-CPU session that builds the expert store
   and routes a calibration text into an expert profile (gpu_two_cards.expert_profile_session).
3. For each cache size (--slots, default 0 = every expert on the CPU runner, and 1024 warm-started from the
   profile) and each --prefill-offload-min of --modes (default 0 = off, then 32 = on): one session,
   hybrid.bench.decode.measure with each --prompt-tokens prompt (default 512: one prefill chunk; a comma
   list is measured in turn: the offload crossover) after a warm-up generation of the same prompt; per session prefill tok/s, the measured prefill step's ms, what
   was streamed (experts, bytes, groups, staging bytes), PCIe bytes by kind, the first greedy ids;
   --chunks 512,2048: each prompt prefilled in steps of each chunk in turn (default: the session's, the
   planner's auto chunk).

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_prefill_stream.py \\
        --profile h200 --prompt-tokens 512 --budget-s 270
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_runtime_check as rc  # noqa: E402  - log / make_synth / run_pytest / run_parts / gpu_name
import gpu_two_cards as tc  # noqa: E402  - expert_profile_session

from hybrid.runtime.store_stage import SOURCE_ENV, SOURCES, STAGE_KERNEL_ENV  # noqa: E402

rc.OUT = tc.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "prefill_stream.jsonl"


record = rc.recorder("tools/gpu_prefill_stream.py", JSONL,
                     ("prefill_tok_s", "prefill_step_ms", "decode_tok_s", "streamed", "ids_equal_first",
                      "ok", "summary", "skipped", "error"))


rc.record = tc.record = record


def runs(path: Path, deadline: float, a) -> None:
    import torch

    from hybrid.bench.decode import measure
    from hybrid.kernels import qpn
    from hybrid.runtime import RuntimeOptions, open_session

    cfg, tok, _, cpu, eprof = tc.expert_profile_session(path, a.profile, a.tokens, a.device)
    ctx = max(a.prompt_tokens) + max(a.tokens, 1) + 8
    first: dict = {}
    for slots in a.slots:
        for m in a.modes:
            check = f"synth_slots{slots}_offload{m}"
            if time.perf_counter() > deadline:
                record({"check": check, "skipped": "device-time deadline"})
                continue
            kw = dict(device=a.device, gpus=(0,), cache_slots=(slots,), profile=a.profile, prefill_offload_min=m)
            if slots:
                kw["expert_profile"] = str(eprof)
            rc.log(f"session {check}: {kw}")
            s = open_session(path, RuntimeOptions(**kw), context=ctx, cpu=cpu)
            try:
                # alternated inside one session (same machine state)
                for src, g, n, ch in [(src, g, n, ch) for src in a.sources for g in a.moe_gemm for n in a.prompt_tokens
                                      for ch in a.chunks]:
                    _set_source(src)
                    qpn.MOE_GEMM[0] = g
                    if ch is not None:
                        s.opts = replace(s.opts, prefill_chunk=ch)
                    st0 = s.model.experts.prefill_stream_stats()
                    rec = measure(s, tok, n, 1, a.tokens)
                    rep = s.report()
                    st1 = s.model.experts.prefill_stream_stats()
                    rec.update({"cache_slots": slots, "prefill_offload_min": m, "prefill_source": src, "moe_gemm": g,
                                "prefill_chunk": s.prefill_chunk, "plan_chunk": s.plan.inputs.prefill_chunk if s.plan else None,
                                "store_pinned": s.model.experts.store_source is not None,
                                "prefill_step_ms": round(1e3 * s.stats.step_s["prefill"][-1], 2),
                                "prefill_steps": s.stats.steps["prefill"],
                                "streamed": {k: st1[k] - st0.get(k, 0) for k in st1},
                                "pcie_bytes": rep["pcie_bytes"], "hit_rate": rep["hit_rate"],
                                "cpu_expert_ms": rep["cpu_expert_ms"], "gpu_expert_ms": rep["gpu_expert_ms"],
                                "max_memory_allocated_gib": round(_peak() / 2**30, 2)})
                    head = rec["generated_ids_head"]
                    rec["ids_equal_first"] = first.setdefault((slots, n), head) == head
                    record({"check": f"{check}_prompt{n}" + (f"_{src}" if len(a.sources) > 1 else "")
                            + (f"_moegemm{g}" if len(a.moe_gemm) > 1 else "")
                            + (f"_chunk{ch}" if len(a.chunks) > 1 else ""), **rec})
                if a.profile_prefill:
                    for src, n in [(src, n) for src in dict.fromkeys(a.sources) for n in a.prompt_tokens]:
                        _set_source(src)
                        profile_prefill(s, tok, n, OUT / f"prefill_profile_s{slots}_m{m}_p{n}_{src}.txt")
            finally:
                s.close()
                del s
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
    cpu.close()


def _set_source(src: str) -> None:
    """--sources item: store (unpack + torch pack, HYBRID_STAGE_KERNEL=0) | checkpoint, or store+kernel (the
    stage-pack kernel, HYBRID_STAGE_KERNEL=1: the default since the eleventh session)."""
    base, _, kernel = src.partition("+")
    os.environ[SOURCE_ENV] = base
    os.environ[STAGE_KERNEL_ENV] = "1" if kernel else "0"


def profile_prefill(s, tok, n_prompt: int, path: Path) -> None:
    """One more prefill (and its first token) under torch.profiler: the GPU time per kernel / copy,
    summed, to `path` (top 25 by device time), its first lines and the wall time to the log."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybrid.bench.decode import prompt_ids
    from hybrid.generate import generate
    from hybrid.sampler import Sampler, SamplerConfig

    ids = prompt_ids(tok, n_prompt)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        generate(s.model, tok, ids, 1, Sampler(SamplerConfig()), prefill_chunk=s.prefill_chunk)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
    path.write_text(f"{path.stem}: wall {wall * 1e3:.1f} ms (prefill {n_prompt} tokens + 1 token, profiled)\n{table}\n")
    rc.log(f"{path.name}: wall {wall * 1e3:.1f} ms\n" + "\n".join(table.splitlines()[:16]))


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _ints(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(v < 0 for v in out):
        raise SystemExit(f"error: {flag} {text}: expected a comma-separated list of integers >= 0")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--prompt-tokens", default="512", help="prompt lengths of the measured prefills (comma list, "
                   "each measured in turn in each session)")
    p.add_argument("--tokens", type=int, default=4, help="tokens decoded after each prefill")
    p.add_argument("--slots", default="0,1024", help="--cache-slots of the sessions, in order")
    p.add_argument("--modes", default="0,32", help="--prefill-offload-min values per cache size, in order (0 = off)")
    p.add_argument("--profile", default="h200", help="hardware profile the plans use")
    p.add_argument("--budget-s", type=float, default=270, help="stop starting new parts/sessions after this")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the sessions")
    p.add_argument("--small", action="store_true", help="a 4-layer, 16-expert synthetic model (smoke runs)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: pytest, synth (reuse "
                   "--synth when it holds a checkpoint)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="after each offload session's runs, one prefill per source under torch.profiler")
    p.add_argument("--sources", default="store",
                   help="comma list of HYBRID_PREFILL_SOURCE values (store, checkpoint; store+kernel: with "
                        "HYBRID_STAGE_KERNEL=1), measured in turn in each session")
    p.add_argument("--moe-gemm", default="auto", help="comma list of HYBRID_MOE_GEMM values (auto, 0, 1, f), "
                   "measured in turn in each session")
    p.add_argument("--chunks", default="", help="comma list of prefill chunks (tokens) measured in turn in each "
                   "session (default: the session's own, the planner's auto chunk)")
    a = p.parse_args()
    a.chunks = _ints("--chunks", a.chunks) if a.chunks else [None]
    a.moe_gemm = [x.strip() for x in a.moe_gemm.split(",") if x.strip()]
    if not a.moe_gemm or any(x not in ("auto", "0", "1", "f") for x in a.moe_gemm):
        print(f"error: --moe-gemm {','.join(a.moe_gemm)}: expected a comma list of auto, 0, 1, f", file=sys.stderr)
        return 2
    a.slots, a.modes = _ints("--slots", a.slots), _ints("--modes", a.modes)
    a.sources = [x.strip() for x in a.sources.split(",") if x.strip()]
    if not a.sources or any(x not in SOURCES + ("store+kernel",) for x in a.sources):
        print(f"error: --sources {','.join(a.sources)}: expected a comma list of {', '.join(SOURCES)}, store+kernel",
              file=sys.stderr)
        return 2
    a.prompt_tokens = _ints("--prompt-tokens", a.prompt_tokens)
    if min(a.prompt_tokens) < 1:
        print(f"error: --prompt-tokens {a.prompt_tokens}: expected >= 1", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = rc.T0 + a.budget_s
    skip = set(a.skip.split(","))
    parts = [] if "pytest" in skip else [("pytest", lambda: rc.run_pytest(["tests/test_prefill_stream_cuda.py", "-s"]))]
    if not ("synth" in skip and (a.synth / "config.json").exists()):
        parts.append(("synth_write", lambda: rc.make_synth(a.synth, a.skew, a.small)))
    parts += [("ab_runs", lambda: runs(a.synth, deadline, a))]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

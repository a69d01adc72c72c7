"""A/B of the overlapped decode (hybrid.generate: the next id sampled on the device, step t+1 enqueued
before the host reads token t) against the plain loop (the host samples, then launches), in one
session per configuration, on the Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint. Writes
$OUT/decode_overlap_ab.jsonl + gpu_check.log.

Per configuration label (tools/gpu_two_cards.configs: synth_one_gpu_cap16 = every expert resident,
synth_one_gpu_slots1024 = layers that can miss, which fall back to the plain step): one session, one
warm-up generation, then the measured generations in the order of --modes (0 = off, 1 = on; default
0,1,0,1 so a drifting VM hits both alike). Per generation: decode tok/s, ms per token, the steps that
ran ahead (HybridModel.enqueue calls), hit rate, and whether the greedy ids equal the label's first
generation's (all of them, not a head). All-resident labels also get the device's own rate
(gpu_bound: steps enqueued back to back, nothing read until the end), the floor of the overlapped loop. The expert profile is uniform (every expert used equally:
the warm start fills every slot it is given, so --vram-cap 16 starts all resident) unless --routed-profile
(an all-CPU session routes a calibration text first, as tools/gpu_miss_graph_ab.py does; slower).

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_decode_overlap_ab.py \\
        --order synth_one_gpu_cap16,synth_one_gpu_slots1024 --modes 0,1,0,1 --tokens 64 --budget-s 110

--small: a 4-layer toy checkpoint instead (a smoke test of the tool and the device path, seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_runtime_check as rc  # noqa: E402  - log / recorder / run_parts / graph_info
import gpu_two_cards as tc  # noqa: E402  - configs(miss_slots, order), expert_profile_session

rc.OUT = tc.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "decode_overlap_ab.jsonl"
record = rc.recorder("tools/gpu_decode_overlap_ab.py", JSONL,
                     ("overlap", "decode_tok_s", "ms_per_token", "ran_ahead", "ids_equal_first", "hit_rate",
                      "skipped", "error", "seconds", "all_resident", "predicted_tok_s", "gpu_bound"))
rc.record = tc.record = record
SMALL = ["--layers", "4", "--experts", "16", "--hidden", "256", "--inter", "128", "--vocab", "1024", "--top-k", "4"]


def make_synth(path: Path, skew: float, small: bool, layers: int | None) -> None:
    t = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "make_synthetic.py"), str(path), "--skew", str(skew)]
    cmd += SMALL if small else (["--layers", str(layers)] if layers else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    rc.log(p.stdout.strip() + p.stderr.strip()[-2000:])
    if p.returncode:
        raise RuntimeError(f"make_synthetic exited {p.returncode}")
    record({"check": "synthetic_written", "path": str(path), "skew": skew, "small": small, "layers": layers,
            "seconds": round(time.perf_counter() - t, 1),
            "gib": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30, 2)})


def synth_args(p: argparse.ArgumentParser) -> None:
    """The synthetic checkpoint's flags, shared by the decode A/B tools."""
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--small", action="store_true", help="a 4-layer toy checkpoint (smoke test)")
    p.add_argument("--layers", type=int, default=None, help="layers of the synthetic checkpoint (default 48)")
    p.add_argument("--reuse", action="store_true", help="use --synth as it is when it holds a checkpoint")


def synth_parts(a) -> list:
    """run_parts' part that writes the checkpoint, unless --reuse finds one at --synth."""
    if a.reuse and (a.synth / "config.json").exists():
        return []
    return [("synth_write", lambda: make_synth(a.synth, a.skew, a.small, a.layers))]


def uniform_profile(path: Path) -> Path:
    """An expert profile with every expert used equally (a warm start fills every slot it is given)."""
    import numpy as np

    from hybrid.experts.popularity import profile_file_dict
    from hybrid.model.config import ModelConfig

    cfg = ModelConfig.from_folder(path)
    tokens = cfg.num_experts * 4
    counts = np.full((cfg.num_hidden_layers, cfg.num_experts), tokens * cfg.num_experts_per_tok // cfg.num_experts,
                     dtype=np.int64)
    out = OUT / "uniform.experts.json"
    out.write_text(json.dumps(profile_file_dict(path.name, cfg.model_type, counts, tokens,
                                                cfg.num_experts_per_tok, {"uniform": True})))
    return out


class NoCpuRunner:
    """--no-cpu-runner: a session whose every expert is resident never calls the CPU runner; building
    the real one (the expert store) only costs device time. Any call fails loudly."""

    def submit(self, *a, **kw):
        raise RuntimeError("--no-cpu-runner: a layer missed (the session is not all resident)")

    sync = submit

    def close(self) -> None:
        pass


def predictions(path: Path, a, kw: dict, eprof: Path, ctx: int) -> dict:
    """The planner's decode tok/s for the configuration with the overlap off and on (PlanRequest.overlap)."""
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions
    from hybrid.runtime.session import _expert_profile, _hardware_profile, _plan

    cfg, out, old = ModelConfig.from_folder(path), {}, os.environ.get("HYBRID_DECODE_OVERLAP")
    opts = RuntimeOptions(device=a.device, profile=a.profile, expert_profile=str(eprof), **kw)
    hw = _hardware_profile(opts)
    ep, ep_path = _expert_profile(path, opts, cfg, strict=hw is not None)
    try:
        for mode in ("0", "1"):
            os.environ["HYBRID_DECODE_OVERLAP"] = mode
            plan = _plan(path, cfg, opts, hw, ep, ep_path, ctx)
            out[mode] = None if plan is None else round(plan.prediction.tok_s, 2)
    finally:
        if old is None:
            os.environ.pop("HYBRID_DECODE_OVERLAP", None)
        else:
            os.environ["HYBRID_DECODE_OVERLAP"] = old
    return out


def measure_one(s, tok, ids: list[int], tokens: int, overlap: bool) -> dict:
    """One measured greedy generation with the overlap on or off; the window's counters."""
    from hybrid.generate import generate
    from hybrid.runtime.monitor import snapshot, window
    from hybrid.sampler import Sampler, SamplerConfig

    hm = s.model
    calls = {"enqueue": 0}
    enqueue = hm.enqueue

    def counted(*a, **kw):
        calls["enqueue"] += 1
        return enqueue(*a, **kw)

    hm.enqueue = counted
    try:
        a, n0 = snapshot(s), s.stats.steps["decode"]
        res = generate(hm, tok, ids, tokens, Sampler(SamplerConfig()), prefill_chunk=s.prefill_chunk,
                       overlap=overlap)
        steps = s.stats.steps["decode"] - n0
        w = window(s, a, snapshot(s), steps)
    finally:
        del hm.enqueue
    return {"overlap": int(overlap), "tokens": len(res.generated_ids), "decode_tok_s": round(res.decode_tok_s, 2),
            "ms_per_token": round(1e3 / res.decode_tok_s, 3) if res.decode_tok_s else None,
            "prefill_tok_s": round(res.prefill_tok_s, 1), "ran_ahead": calls["enqueue"], "decode_steps": steps,
            "generated_ids": res.generated_ids, **w}


def gpu_bound(s, ids: list[int], steps: int) -> dict:
    """`steps` steps enqueued back to back (HybridModel.enqueue + the device sampler, no token read, no
    bookkeeping until the end): the device's own rate, the floor of the overlapped decode's ms per token."""
    import torch

    from hybrid.sampler import DeviceSampler, Sampler, SamplerConfig

    hm = s.model
    hm.new_cache(len(ids) + steps + 1)
    logits = hm.forward(torch.tensor(ids), 0, last_only=True)
    ds = DeviceSampler(Sampler(SamplerConfig()), ids, logits.shape[-1], logits.device)
    tok, host = ds(logits[-1])
    host.read()
    pending, t0 = [], time.perf_counter()
    for j in range(steps):
        st = hm.enqueue(tok, len(ids) + j)
        tok, host = ds(st.logits[-1])
        pending.append(st)
    t_enq = time.perf_counter()
    host.read()
    t1 = time.perf_counter()
    for st in pending:
        hm.finish(st)
    return {"steps": steps, "ms_per_token": round((t1 - t0) / steps * 1e3, 3),
            "host_enqueue_ms_per_step": round((t_enq - t0) / steps * 1e3, 3),
            "bookkeeping_ms_per_step": round((time.perf_counter() - t1) / steps * 1e3, 3)}


def host_profile(s, tok, ids: list[int], tokens: int, top: int = 20) -> dict:
    """cProfile of one overlapped generation: the host's own time per token by function."""
    import cProfile

    from hybrid.generate import generate
    from hybrid.sampler import Sampler, SamplerConfig

    prof = cProfile.Profile()
    prof.enable()
    res = generate(s.model, tok, ids, tokens, Sampler(SamplerConfig()), prefill_chunk=s.prefill_chunk, overlap=True)
    prof.disable()
    n = max(len(res.generated_ids), 1)
    return {"tokens": n, "top": rc.top_functions(prof, n, top)}


def runs(path: Path, deadline: float, a) -> None:
    import torch

    from hybrid.bench.decode import prompt_ids
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions, open_session
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    ctx, cpu = 32 + a.tokens + 8, None
    if a.routed_profile:
        cfg, tok, ctx, cpu, eprof = tc.expert_profile_session(path, a.profile, a.tokens, a.device)
    else:
        eprof = uniform_profile(path)
    ids = prompt_ids(tok, 32)
    for label, kw in tc.configs(a.miss_slots, a.order):
        if time.perf_counter() > deadline:
            record({"check": label, "skipped": "device-time deadline"})
            continue
        rc.log(f"session {label}: {kw}")
        t = time.perf_counter()
        stub = a.no_cpu_runner and "vram_cap_gib" in kw
        s = open_session(path, RuntimeOptions(device=a.device, profile=a.profile, expert_profile=str(eprof), **kw),
                         context=ctx, cpu=NoCpuRunner() if stub else cpu)
        if cpu is None and not stub:
            cpu, s.owns_cpu = s.cpu, False
        try:
            hm = s.model
            hm.prompt_tokens = len(ids)
            resident = all(hm.experts.device_only(l) for l in range(cfg.num_hidden_layers))
            record({"check": f"{label}_open", "seconds": round(time.perf_counter() - t, 1), "all_resident": resident,
                    "predicted_tok_s": predictions(path, a, kw, eprof, ctx),
                    "placement": s.placement.describe(), "load_s": {k: round(v, 2) for k, v in s.load_s.items()}})
            measure_one(s, tok, ids, a.warmup, True)                          # graphs, embed table, caches
            first = None
            for mode in a.modes:
                if time.perf_counter() > deadline:
                    record({"check": f"{label}_overlap{mode}", "skipped": "device-time deadline"})
                    continue
                rec = measure_one(s, tok, ids, a.tokens, mode == "1")
                first = rec["generated_ids"] if first is None else first
                rec["ids_equal_first"] = rec["generated_ids"] == first
                rec["generated_ids"] = rec["generated_ids"][:16]
                record({"check": f"{label}_overlap{mode}", "flags": kw, **rec, **rc.graph_info(s)})
            if resident and a.device == "cuda" and time.perf_counter() < deadline:
                record({"check": f"{label}_gpu_bound", "gpu_bound": gpu_bound(s, ids, a.tokens)})
            if a.host_profile and time.perf_counter() < deadline:
                record({"check": f"{label}_host_profile", "host_profile": host_profile(s, tok, ids, a.tokens)})
        finally:
            s.close()
            del s
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if cpu is not None:
        cpu.close()


def main() -> int:
    p = argparse.ArgumentParser()
    synth_args(p)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the tool here")
    p.add_argument("--tokens", type=int, default=64, help="measured tokens per generation")
    p.add_argument("--warmup", type=int, default=16, help="tokens of the session's warm-up generation")
    p.add_argument("--budget-s", type=float, default=110, help="stop starting new generations after this")
    p.add_argument("--miss-slots", type=int, default=1024, help="expert slots of the sessions with misses")
    p.add_argument("--profile", default="h200", help="hardware profile the plans use")
    p.add_argument("--order", default=None, help="configuration labels (tools/gpu_two_cards.configs; default "
                   "synth_one_gpu_cap16,synth_one_gpu_slots<--miss-slots>)")
    p.add_argument("--modes", default="0,1,0,1", help="overlap off (0) / on (1), in order, per label")
    p.add_argument("--routed-profile", action="store_true", help="route a calibration text for the expert profile")
    p.add_argument("--no-cpu-runner", action="store_true",
                   help="no CPU runner (expert store) for the --vram-cap labels (all resident: never called)")
    p.add_argument("--host-profile", action="store_true", help="also cProfile one overlapped generation per label")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or any(m not in ("0", "1") for m in a.modes):
        print("error: --modes: expected a comma-separated list of 0 and 1", file=sys.stderr)
        return 2
    a.order = a.order or f"synth_one_gpu_cap16,synth_one_gpu_slots{a.miss_slots}"
    deadline = rc.T0 + a.budget_s
    parts = synth_parts(a) + [("ab_runs", lambda: runs(a.synth, deadline, a))]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

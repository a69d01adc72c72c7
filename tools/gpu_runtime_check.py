"""The one script the runtime's GPU call runs (issue 7). Writes $OUT/runtime_gpu.jsonl + a log.

1. Tiny model (NVFP4 copy, carried in scratch/): hybrid-run --device cuda --gpus 0,0 at every split
   point and cache size; greedy ids vs the CPU reference computed on the dev machine (carried) and
   vs the reference model on CUDA.
2. Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint generated here (tools/make_synthetic.py):
   a) all experts on the CPU runner (one card, 0 slots): decode tok/s; its routing -> an expert profile
   b) two logical cards on GPU 0, --vram-cap 16 each, planner split + slots, warm start from the profile:
      decode tok/s, per-card hit rates, prediction vs measurement
   c) the same with --vram-cap 8 (more misses) when time is left.
Everything has a deadline; what did not run is recorded as skipped.

    PYTHONPATH=. python3 tools/gpu_runtime_check.py --tiny-ref scratch/tiny_ref.json

Decode-speed run (results/runtime.md section 7): HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> ...
    --calibrate (hybrid-bench calibrate --base h200 -> $OUT/h200.json, used for every plan after)
    --pytest "tests/test_decode_graphs.py tests/test_runtime_cuda.py" (CUDA tests first)
Each synthetic session is measured with CUDA graphs on, then off (the eager path), and the
all-resident one gets a step profile (host time to issue a step, wall and GPU-event time).

Planner-model run (results/runtime.md section 8): --calibrate also measures graph_kernel_us, launch_us,
lookup_us; the synthetic part opens the all-CPU session, writes the expert profile, then records the
planner's predictions for every configuration (all-CPU, --vram-cap 16, --vram-cap 8, --cache-slots
--miss-slots per card: real CPU misses) from the profile calibrated in this call BEFORE any decode
is measured; --modes graphs skips the eager re-measurement; the cap-16 session counts the kernels
of one eager decode step (torch.profiler) to check planner.step_shape.

scratch/tiny_ref.json (not committed) is the CPU reference for the current tiny weights, made here:
    hybrid-quantize tiny /tmp/tiny_nvfp4 && hybrid-run --model /tmp/tiny_nvfp4 -p "def fibonacci(n):" -n 24 --json
    -> {"prompt": "def fibonacci(n):", "n": 24, "generated_ids": [...]}
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()
OUT = Path(os.environ.get("OUT", "scratch/out"))


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    with (OUT / "gpu_check.log").open("a") as f:
        f.write(line + "\n")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def gpu_fields() -> dict:
    """A device record's GPU: its name, the driver's version and the SM clock as the record is made, right after
    what it measured (the same code can time differently under another driver or clock)."""
    from hybrid.hardware import driver_version, sm_clocks

    return {"gpu": gpu_name(), "driver": driver_version(), "clocks": sm_clocks(0)}


def recorder(tool: str, jsonl: str, keys: tuple, machine=None):
    """record(rec) for a device tool: the record stamped with machine, command and git sha (the
    device copy has no .git: HYBRID_GIT_SHA) and the GPU (or machine()'s fields), appended to
    OUT/jsonl (OUT as the tool set it here), its `keys` logged."""
    def record(rec: dict) -> None:
        from hybrid.baselines.report import stamp

        rec = {**rec, **stamp(tool), **(machine() if machine else gpu_fields())}
        if os.environ.get("HYBRID_GIT_SHA"):
            rec["git_sha"] = os.environ["HYBRID_GIT_SHA"]
        with (OUT / jsonl).open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"record {rec.get('check')}: " + json.dumps({k: v for k, v in rec.items() if k in keys}))
    return record


record = recorder("tools/gpu_runtime_check.py", "runtime_gpu.jsonl",
                  ("ok", "decode_tok_s", "measured_over_predicted", "match", "skipped", "error"))


def top_functions(prof, per: int, top: int) -> list:
    """A cProfile.Profile's `top` functions by own time: [file:line(name), us per unit, calls per unit]
    over `per` units (steps, tokens)."""
    import pstats

    st = pstats.Stats(prof).stats
    rows = sorted(((f"{Path(f).name}:{line}({name})", tt, nc) for (f, line, name), (_, nc, tt, _, _) in st.items()),
                  key=lambda r: -r[1])
    return [[name, round(tt / per * 1e6, 1), round(nc / per, 2)] for name, tt, nc in rows[:top]]


def run_cli(args: list[str]) -> dict:
    from hybrid.cli.run import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([str(a) for a in args])
    if rc != 0:
        raise RuntimeError(f"hybrid-run {' '.join(map(str, args))} exited {rc}")
    return json.loads(buf.getvalue())


def run_parts(parts: list, deadline: float, record, log) -> None:
    """Run (name, fn) parts in order; a part that would start after `deadline` is recorded as skipped,
    one that raises is recorded with its error (traceback to `log`) and the next part runs."""
    for name, fn in parts:
        if time.perf_counter() > deadline:
            record({"check": name, "skipped": "device-time deadline"})
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - record and go on to the next part
            record({"check": name, "error": f"{type(exc).__name__}: {exc}"})
            log(traceback.format_exc())


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def calibrate_h200(state: dict, name: str = "h200") -> None:
    """hybrid-bench calibrate --base h200 -> $OUT/<name>.json; later parts plan with it."""
    t = time.perf_counter()
    out = OUT / f"{name}.json"
    cmd = [sys.executable, "-m", "hybrid.cli.bench", "calibrate", "--base", "h200", "--ram-usable-gib", "120",
           "--out", str(out), "--name", name]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log(p.stdout.strip()[-3000:] + p.stderr.strip()[-2000:])
    ok = p.returncode == 0 and out.is_file()
    if ok:
        state["profile"] = str(out)
    record({"check": "calibrate", "ok": ok, "seconds": round(time.perf_counter() - t, 1),
            "command": "hybrid-bench " + " ".join(cmd[3:])})


def run_pytest(args: list[str], timeout: int = 150, lines: int = 25) -> None:
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs",
                            *args], capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:                       # keep what it printed before the limit
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out, rc = text(exc.stdout) + text(exc.stderr) + f"\n(pytest stopped after {timeout} s)", None
    tail = out.strip().splitlines()[-lines:]
    log("\n".join(tail))
    record({"check": "pytest_cuda", "ok": rc == 0, "rc": rc, "args": args,
            "seconds": round(time.perf_counter() - t, 1), "summary": tail[-1] if tail else ""})


def tiny_checks(tiny: Path, ref: dict, device: str, profile: str = "h200", gpus: str = "0,0") -> None:
    """Greedy ids of hybrid-run on the tiny NVFP4 model at every split point of two cards (`gpus`:
    0,0 two logical cards on GPU 0, 0,1 two physical GPUs) and on one card, against the references."""
    if not (tiny / "config.json").is_file():       # the same bytes as on the dev machine: deterministic
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "hybrid.cli.quantize", "tiny", str(tiny), "--no-progress"],
                           capture_output=True, text=True)
        log(f"hybrid-quantize tiny: rc {p.returncode} in {time.perf_counter() - t:.1f} s {p.stderr[-300:]}")
    base = ["--model", tiny, "--prompt", ref["prompt"], "-n", ref["n"], "--json", "--device", device]
    cuda_ref = run_cli(base)["generated_ids"]
    want = ref["generated_ids"]
    record({"check": "tiny_reference_cuda", "match_cpu_reference": cuda_ref == want,
            "prefix_match": prefix_match(cuda_ref, want), "n": len(want), "ids": cuda_ref})
    per_layer = 32
    for split, frac in ((1, 0.0), (2, 0.5), (3, 1.0), (None, 0.5)):
        flags = ["--gpus", gpus, "--layer-split", str(split)] if split else ["--gpus", "0"]
        cards = 2 if split else 1
        layers = [split, 4 - split] if split else [4]
        slots = ",".join(str(int(frac * per_layer * n)) for n in layers)
        d = run_cli(base + flags + ["--cache-slots", slots, "--profile", profile])
        got, st = d["generated_ids"], d["stats"]
        record({"check": "tiny_hybrid_cuda", "gpus": gpus if split else "0", "split": split, "cards": cards,
                "cache_frac": frac, "command": "hybrid-run " + " ".join(map(str, flags)),
                "match_cpu_reference": got == want, "match_cuda_reference": got == cuda_ref,
                "prefix_match_cpu": prefix_match(got, want), "n": len(want),
                "hit_rate": st["hit_rate"], "decode_tok_s": d["decode_tok_s"],
                "slot_storage": st["slot_storage"], "cpu_runner": st["cpu_runner"],
                "graph_steps": st.get("graph_steps")})


def make_synth(path: Path, skew: float, small: bool) -> None:
    t = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "make_synthetic.py"), str(path), "--skew", str(skew)]
    if small:
        cmd += ["--layers", "4", "--experts", "16", "--hidden", "256", "--inter", "128", "--vocab", "1024",
                "--top-k", "4"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log(p.stdout.strip() + p.stderr.strip()[-2000:])
    if p.returncode:
        raise RuntimeError(f"make_synthetic exited {p.returncode}")
    record({"check": "synthetic_written", "path": str(path), "skew": skew,
            "seconds": round(time.perf_counter() - t, 1),
            "gib": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30, 2)})


def calibrate_profile(session, tok, path: Path, out: Path) -> None:
    """Routing counts of a few calibration prefills + decodes through the session -> experts.json."""
    import numpy as np
    import torch

    from hybrid.experts.popularity import profile_file_dict

    cfg = session.model.cfg
    counts = np.zeros((cfg.num_hidden_layers, cfg.num_experts), dtype=np.int64)
    inner = session.model.model
    inner.on_route = lambda l, ids, w: np.add.at(counts[l], ids.cpu().numpy().ravel(), 1)
    rng = np.random.default_rng(1)
    tokens = 0
    for _ in range(2):
        ids = rng.integers(3, cfg.vocab_size, 128).tolist()
        session.model.new_cache(len(ids) + 1)
        session.model.forward(torch.tensor(ids), 0, last_only=True)
        tokens += len(ids)
    inner.on_route = None
    d = profile_file_dict(path.name, cfg.model_type, counts, tokens, cfg.num_experts_per_tok,
                          {"command": "tools/gpu_runtime_check.py calibrate_profile", "texts": 2,
                           "prompts": "random token ids"})
    out.write_text(json.dumps(d) + "\n")


def step_profile(session, steps: int = 16) -> dict:
    """Host time to issue one decode step (all layers resident) and its wall / GPU time, eager vs
    graphs: per step, perf_counter around the launch, then a sync; CUDA events around the step.
    Expert bookkeeping is left out (the step is aborted), so this is the dense path + kernels."""
    import statistics

    import torch

    hm, inner, ex = session.model, session.model.model, session.model.experts
    n_layers = inner.cfg.num_hidden_layers
    cap = inner.cache.max_tokens if inner.cache is not None else 64
    hm.new_cache(cap)
    out = {}
    for mode in ("eager", "graphs"):
        if mode == "graphs" and (hm.graphs is None or hm.graphs.error):
            continue
        host, wall, gpu = [], [], []
        for j in range(steps + 3):
            ids = torch.tensor([100 + j])
            ex.begin_step(1, "decode")
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            if mode == "eager":
                inner.forward(ids, j, last_only=True)
            else:
                hm.graphs.step(ids, j)
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            ex.abort_step()
            if j >= 3:
                host.append(t1 - t0)
                wall.append(t2 - t0)
                gpu.append(e0.elapsed_time(e1) / 1e3)
        med = lambda v: statistics.median(v) * 1e3  # noqa: E731
        out[mode] = {"host_issue_ms_per_step": round(med(host), 3),
                     "host_issue_us_per_layer": round(med(host) * 1e3 / n_layers, 1),
                     "wall_ms_per_step": round(med(wall), 3), "gpu_events_ms_per_step": round(med(gpu), 3),
                     "steps": steps}
    return out


def synth_configs(miss_slots: int) -> list[tuple[str, dict]]:
    """(label, RuntimeOptions fields) of the two-card sessions, in the order they are measured."""
    return [("synth_two_cards_cap16", dict(gpus=(0, 0), vram_cap_gib=(16.0,))),
            ("synth_two_cards_cap8", dict(gpus=(0, 0), vram_cap_gib=(8.0,))),
            (f"synth_two_cards_slots{miss_slots}", dict(gpus=(0, 0), cache_slots=(miss_slots,)))]


def predictions_before(path: Path, profile: str, expert_profile: Path, ctx: int, miss_slots: int) -> dict:
    """The planner's predictions for every synthetic configuration, made the way open_session plans
    (hybrid.runtime.session._plan), recorded before any decode is measured."""
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions
    from hybrid.experts.popularity import load_profile as load_expert_profile
    from hybrid.runtime.session import _hardware_profile, _plan

    cfg = ModelConfig.from_folder(path)
    out = {}
    configs = [("synth_all_cpu", dict(gpus=(0,), cache_slots=(0,)), None)]
    configs += [(label, kw, expert_profile) for label, kw in synth_configs(miss_slots)]
    for label, kw, eprof in configs:
        opts = RuntimeOptions(device="cuda", profile=profile, **kw)
        ep = load_expert_profile(Path(eprof), cfg) if eprof is not None else None
        plan = _plan(path, cfg, opts, _hardware_profile(opts), ep, eprof, ctx)
        p = plan.prediction
        out[label] = {"tok_s": round(p.tok_s, 2), "token_ms": round(p.token_us / 1e3, 3),
                      "host_ms": round(p.host_us / 1e3, 3), "kernel_ms": round(p.kernel_us / 1e3, 3),
                      "hit_rate": round(p.hit_rate, 4), "split": list(plan.inputs.layer_split),
                      "slots": [c.slots for c in plan.cards],
                      "resident_layers": sum(x.resident for x in p.layers),
                      "cpu_mb_per_token": round(p.cpu_bytes / 1e6, 2), "gpu_mb_per_token": round(p.gpu_bytes / 1e6, 1)}
        log(f"prediction {label}: {json.dumps(out[label])}")
    record({"check": "predictions_before_decode", "profile": profile, "context": ctx, "predictions": out})
    return out


def kernel_count(session) -> dict:
    """CUDA kernels of one eager decode step (the graphed step runs the same kernels), by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hm, inner, ex = session.model, session.model.model, session.model.experts
    hm.new_cache(64)
    for j in range(3):                          # warm: lazy packing, library handles
        ex.begin_step(1, "decode")
        inner.forward(torch.tensor([100 + j]), j, last_only=True)
        ex.abort_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ex.begin_step(1, "decode")
        inner.forward(torch.tensor([200]), 3, last_only=True)
        torch.cuda.synchronize()
        ex.abort_step()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    layers = inner.cfg.num_hidden_layers
    return {"kernels_per_step": len(kernels), "copies_per_step": len(names) - len(kernels),
            "kernels_per_layer": round(len(kernels) / layers, 2), "layers": layers}


def graph_info(session) -> dict:
    g = session.model.graphs
    if g is None:
        return {"graphs": None}
    return {"graphs": {"enabled": g.enabled, "captures": g.captures, "error": g.error,
                       "graph_steps": session.stats.graph_steps}}


def measure_modes(s, tok, tokens: int, label: str, modes=("graphs", "eager"), deadline: float = 1e18) -> None:
    """decode measurement with CUDA graphs on, then off (the eager path), in one session."""
    from hybrid.bench.decode import measure

    g = s.model.graphs
    for mode in modes:
        if time.perf_counter() > deadline:
            record({"check": f"{label}_{mode}", "skipped": "device-time deadline"})
            continue
        if g is not None:
            g.enabled = mode == "graphs"
        steps0 = s.stats.graph_steps
        rec = measure(s, tok, 32, 16, tokens)
        rec["graph_steps_measured"] = s.stats.graph_steps - steps0
        record({"check": f"{label}_{mode}", "mode": mode, **rec, **graph_info(s)})
    if g is not None:
        g.enabled = True


def synth_runs(path: Path, deadline: float, tokens: int, device: str, profile: str = "h200",
               modes=("graphs", "eager"), miss_slots: int = 1024) -> None:
    import torch

    from hybrid.bench.decode import measure

    cuda = device == "cuda"
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions, open_session
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    ctx = 32 + tokens
    log("session: all experts on the CPU runner (builds the expert store)")
    s0 = open_session(path, RuntimeOptions(device=device, gpus=(0,), cache_slots=(0,), profile=profile),
                      context=ctx)
    cpu = s0.cpu
    log(f"  loaded {s0.load_s}")
    prof = OUT / "synth30.experts.json"
    calibrate_profile(s0, tok, path, prof)            # routing counts first: the predictions need them
    predictions_before(path, profile, prof, ctx, miss_slots)
    rec = measure(s0, tok, 32, 1, 8)
    record({"check": "synth_all_cpu", "vram_cap_gib": None, **rec, **graph_info(s0),
            "store_backing": getattr(getattr(cpu, "store", None), "backing", None),
            "cpu_threads": getattr(getattr(cpu, "runner", None), "threads", None)})
    s0.owns_cpu = False                  # the runner serves the next sessions; closed at the end
    s0.close()
    del s0
    torch.cuda.empty_cache() if cuda else None
    for label, kw in synth_configs(miss_slots):
        if time.perf_counter() > deadline:
            record({"check": label, "skipped": "device-time deadline"})
            continue
        log(f"session {label}: {kw}")
        torch.cuda.reset_peak_memory_stats() if cuda else None
        s = open_session(path, RuntimeOptions(device=device, profile=profile, expert_profile=str(prof), **kw),
                         context=ctx, cpu=cpu)
        log(f"  loaded {s.load_s}; {s.placement.describe()}")
        alloc = torch.cuda.memory_allocated(0) if cuda else 0
        measure_modes(s, tok, tokens, label, modes=modes, deadline=deadline)
        cap = kw.get("vram_cap_gib", (None,))[0]
        rec = {"vram": {"allocated_gib_both_cards": round(alloc / 2**30, 2),
                        "peak_gib_both_cards": round(torch.cuda.max_memory_allocated(0) / 2**30, 2) if cuda else 0,
                        "slot_storage_gib": [round(c.slots.nbytes / 2**30, 2) for c in s.cards],
                        "plan_used_gib": [round(c.used_bytes / 2**30, 2) for c in s.plan.cards],
                        "cap_gib": cap},
               "plan_split": list(s.plan.inputs.layer_split), "placement": s.placement.describe(),
               "full_layers": [len(c.full) for c in s.cards]}
        if cuda and all(len(c.full) == len(c.spec.layer_ids) for c in s.cards):
            for name, fn in (("step_profile", step_profile), ("kernel_count", kernel_count)):
                try:
                    rec[name] = fn(s)
                except Exception as exc:  # noqa: BLE001
                    rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        record({"check": f"{label}_session", **rec, **graph_info(s)})
        s.close()
        del s
        torch.cuda.empty_cache() if cuda else None
    cpu.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", type=Path, default=Path("/tmp/tiny_nvfp4"),
                   help="NVFP4 copy of the tiny model (made with hybrid-quantize when missing)")
    p.add_argument("--tiny-ref", type=Path, default=Path("scratch/tiny_ref.json"))
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=330, help="stop starting new parts after this")
    p.add_argument("--device", default="cuda", help="cuda (the GPU call) or cpu (a dry run here)")
    p.add_argument("--small", action="store_true", help="a small synthetic shape (dry run)")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--calibrate", action="store_true",
                   help="first run hybrid-bench calibrate --base h200 into $OUT/h200.json and plan with it")
    p.add_argument("--pytest", default="", help="pytest node ids/files to run first (CUDA tests), space-separated")
    p.add_argument("--modes", default="graphs,eager", help="decode modes measured per two-card session")
    p.add_argument("--miss-slots", type=int, default=1024,
                   help="expert slots per card of the session with real CPU misses (default 1024 of 3072)")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = T0 + a.budget_s
    log(subprocess.run(["nvidia-smi" if a.device == "cuda" else "true", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip())
    state = {"profile": "h200"}
    parts = [("calibrate", lambda: calibrate_h200(state))] if a.calibrate else []
    parts += [("pytest", lambda: run_pytest(a.pytest.split()))] if a.pytest else []
    parts += [("tiny", lambda: tiny_checks(a.tiny, json.loads(a.tiny_ref.read_text()), a.device,
                                           state["profile"]))] if not a.skip_tiny else []
    parts += [("synth_write", lambda: make_synth(a.synth, a.skew, a.small)),
              ("synth_runs", lambda: synth_runs(a.synth, deadline, a.tokens, a.device, state["profile"],
                                                tuple(a.modes.split(",")), a.miss_slots))]
    run_parts(parts, deadline, record, log)
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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


def record(rec: dict) -> None:
    from hybrid.baselines.report import stamp

    rec = {**rec, **stamp("tools/gpu_runtime_check.py"), "gpu": gpu_name()}
    with (OUT / "runtime_gpu.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")
    log(f"record {rec.get('check')}: " + json.dumps({k: v for k, v in rec.items()
                                                    if k in ("ok", "decode_tok_s", "measured_over_predicted",
                                                             "match", "skipped", "error")}))


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def run_cli(args: list[str]) -> dict:
    from hybrid.cli.run import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([str(a) for a in args])
    if rc != 0:
        raise RuntimeError(f"hybrid-run {' '.join(map(str, args))} exited {rc}")
    return json.loads(buf.getvalue())


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tiny_checks(tiny: Path, ref: dict, device: str) -> None:
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
        flags = ["--gpus", "0,0", "--layer-split", str(split)] if split else ["--gpus", "0"]
        cards = 2 if split else 1
        layers = [split, 4 - split] if split else [4]
        slots = ",".join(str(int(frac * per_layer * n)) for n in layers)
        d = run_cli(base + flags + ["--cache-slots", slots, "--profile", "h200"])
        got, st = d["generated_ids"], d["stats"]
        record({"check": "tiny_hybrid_cuda", "split": split, "cards": cards, "cache_frac": frac,
                "match_cpu_reference": got == want, "match_cuda_reference": got == cuda_ref,
                "prefix_match_cpu": prefix_match(got, want), "n": len(want),
                "hit_rate": st["hit_rate"], "decode_tok_s": d["decode_tok_s"],
                "slot_storage": st["slot_storage"], "cpu_runner": st["cpu_runner"]})


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

    from hybrid.cli.profile import profile_dict

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
    d = profile_dict(path.name, cfg.model_type, counts, tokens, cfg.num_experts_per_tok,
                     {"command": "tools/gpu_runtime_check.py calibrate_profile", "texts": 2,
                      "prompts": "random token ids"})
    out.write_text(json.dumps(d) + "\n")


def synth_runs(path: Path, deadline: float, tokens: int, device: str) -> None:
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
    s0 = open_session(path, RuntimeOptions(device=device, gpus=(0,), cache_slots=(0,), profile="h200"),
                      context=ctx)
    cpu = s0.cpu
    log(f"  loaded {s0.load_s}")
    rec = measure(s0, tok, 32, 1, 8)
    record({"check": "synth_all_cpu", "vram_cap_gib": None, **rec,
            "store_backing": getattr(getattr(cpu, "store", None), "backing", None),
            "cpu_threads": getattr(getattr(cpu, "runner", None), "threads", None)})
    prof = OUT / "synth30.experts.json"
    calibrate_profile(s0, tok, path, prof)
    s0.owns_cpu = False                  # the runner serves the next sessions; closed at the end
    s0.close()
    del s0
    torch.cuda.empty_cache() if cuda else None
    for cap in (16.0, 8.0):
        if time.perf_counter() > deadline:
            record({"check": f"synth_two_cards_cap{cap:g}", "skipped": "device-time deadline"})
            continue
        log(f"session: two logical cards on GPU 0, --vram-cap {cap:g} each")
        torch.cuda.reset_peak_memory_stats() if cuda else None
        s = open_session(path, RuntimeOptions(device=device, gpus=(0, 0), vram_cap_gib=(cap,), profile="h200",
                                              expert_profile=str(prof)), context=ctx, cpu=cpu)
        log(f"  loaded {s.load_s}; {s.placement.describe()}")
        alloc = torch.cuda.memory_allocated(0) if cuda else 0
        rec = measure(s, tok, 32, 16, tokens)
        rec["vram"] = {"allocated_gib_both_cards": round(alloc / 2**30, 2),
                       "peak_gib_both_cards": round(torch.cuda.max_memory_allocated(0) / 2**30, 2) if cuda else 0,
                       "slot_storage_gib": [round(c.slots.nbytes / 2**30, 2) for c in s.cards],
                       "plan_used_gib": [round(c.used_bytes / 2**30, 2) for c in s.plan.cards],
                       "cap_gib": cap}
        rec["plan_split"] = list(s.plan.inputs.layer_split)
        record({"check": f"synth_two_cards_cap{cap:g}", **rec})
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
    p.add_argument("--skew", type=float, default=0.6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget-s", type=float, default=330, help="stop starting new parts after this")
    p.add_argument("--device", default="cuda", help="cuda (the GPU call) or cpu (a dry run here)")
    p.add_argument("--small", action="store_true", help="a small synthetic shape (dry run)")
    p.add_argument("--skip-tiny", action="store_true")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = T0 + a.budget_s
    log(subprocess.run(["nvidia-smi" if a.device == "cuda" else "true", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip())
    parts = [("tiny", lambda: tiny_checks(a.tiny, json.loads(a.tiny_ref.read_text()), a.device))] if not a.skip_tiny else []
    parts += [("synth_write", lambda: make_synth(a.synth, a.skew, a.small)),
              ("synth_runs", lambda: synth_runs(a.synth, deadline, a.tokens, a.device))]
    for name, fn in parts:
        if time.perf_counter() > deadline:
            record({"check": name, "skipped": "device-time deadline"})
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - record and go on to the next part
            record({"check": name, "error": f"{type(exc).__name__}: {exc}"})
            log(traceback.format_exc())
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""llama.cpp beside hybrid on the same Qwen3-30B-A3B-shaped NVFP4 checkpoint, in one device call (issue 7).

1. environment: llama-cpp-python (from --site) in a child process: version, build info, ggml devices;
   on --device cuda a GPU must be among them (else llama.cpp would silently run on the CPU).
2. the synthetic checkpoint (tools/make_synthetic.py, --skew; 16.85 GiB at the 30B-A3B shape)
3. its GGUF (hybrid.baselines.gguf_export: the NVFP4 weights re-packed bit for bit, qwen3moe), in a child
   process in the background while hybrid loads; nothing is timed until it has finished.
4. hybrid on the checkpoint (hybrid.bench.decode.measure, as tools/gpu_runtime_check.py does):
   a) every expert on the CPU runner (1 card, --cache-slots 0); its routing -> an expert profile
   b) --gpus 0,0 --vram-cap 16 --profile h200, warm-started from that profile
5. llama.cpp on the GGUF, one child process per placement, with hybrid's prompt ids, warm-up, tokens
   and threads (hybrid's sessions are closed first):
   a) every layer on the GPU but the expert tensors on the CPU (llama.cpp's --cpu-moe pattern)
   b) every layer on the GPU (n_gpu_layers=-1)
6. a markdown table ($OUT/llama_ab.md) of decode and prefill tok/s, with the planner's prediction.
   Decode tok/s = (tokens - 1) / wall time of the decode steps, each with its argmax, for both engines
   (hybrid.generate's count). llama.cpp's median step stays in the JSONL only: on CUDA llama_decode
   returns before the GPU finishes, so a single step's time is not a speed. VRAM: llama.cpp, what the GPU's
   used memory grew by over the load (weights, KV, compute buffers); hybrid, torch's peak allocation.

Records go to $OUT/llama_ab.jsonl (machine, command, git sha: HYBRID_GIT_SHA on the device).
Children get LD_LIBRARY_PATH with the CUDA 13 libraries of torch's nvidia-* wheels (libcudart.so.13,
libcublas.so.13) and PYTHONPATH with --site, so the parent needs neither; each child ends with the
model it loaded, so VRAM and threads are free for the next part.

    # device (.whl/: llama-cpp-python built with CUDA, gguf, PyYAML, diskcache, jinja2, MarkupSafe wheels
    # and libgomp.so.1 in case the machine has none):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && cp .whl/libgomp.so.1 /tmp/site/
    HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_llama_ab.py --site /tmp/site --pytest tests/test_llama_offload.py
    # dry run on a CPU machine (a small synthetic shape, the same code path):
    OUT=/tmp/ab PYTHONPATH=. python3 tools/gpu_llama_ab.py --device cpu --small
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", "scratch/out"))
SMALL = ["--layers", "4", "--experts", "16", "--hidden", "256", "--inter", "128", "--vocab", "1024", "--top-k", "4"]


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    with (OUT / "llama_ab.log").open("a") as f:
        f.write(line + "\n")


def record(rec: dict) -> dict:
    from hybrid.baselines.report import append_jsonl, stamp

    rec = {**rec, **stamp("tools/gpu_llama_ab.py")}
    if os.environ.get("HYBRID_GIT_SHA"):          # the device copy has no .git
        rec["git_sha"] = os.environ["HYBRID_GIT_SHA"]
    append_jsonl(OUT / "llama_ab.jsonl", [rec])
    keys = ("ok", "decode_tok_s", "prefill_tok_s", "measured_over_predicted_at_context", "skipped", "error",
            "seconds")
    log(f"record {rec.get('check')}: " + json.dumps({k: v for k, v in rec.items() if k in keys}))
    return rec


# ---------------------------------------------------------------- child processes (llama.cpp)

def cuda_lib_dirs(paths: list[str] | None = None) -> list[str]:
    """Folders of the CUDA libraries that pip's nvidia-* wheels (torch's dependencies) install:
    <site-packages>/nvidia/**/lib holding lib*.so.*; llama.cpp's CUDA build needs libcudart/libcublas."""
    out = []
    for base in paths if paths is not None else sys.path:
        nv = Path(base or ".") / "nvidia"
        if not nv.is_dir():
            continue
        for lib in sorted(nv.glob("**/lib")):
            if lib.is_dir() and any(lib.glob("lib*.so*")) and str(lib) not in out:
                out.append(str(lib))
    return out


def child_env(site: str | None) -> dict:
    env = dict(os.environ)
    py = [p for p in (site, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(py)
    libs = [*cuda_lib_dirs(), site, env.get("LD_LIBRARY_PATH")]        # site: a carried libgomp.so.1, if any
    libs = [x for x in libs if x]
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env.pop("OMP_NUM_THREADS", None)
    return env


class Child:
    """This script with --child SPEC in a fresh process; `result()` -> the JSON object it prints last."""

    def __init__(self, spec: dict, env: dict):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float) -> dict:
        try:
            out, err = self.p.communicate(timeout=max(timeout, 5))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.communicate()
            return {"error": f"child timed out after {time.perf_counter() - self.t0:.0f} s"}
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if self.p.returncode or not lines:
            return {"error": f"child exited {self.p.returncode}: {(out[-800:] + err[-1500:]).strip()}"}
        return json.loads(lines[-1])


def run_child(spec: dict, env: dict, timeout: float) -> dict:
    return Child(spec, env).result(timeout)


def child(spec: dict) -> int:
    """Runs in the child: 'info' or one llama.cpp load + decode_speed; prints one JSON line."""
    try:
        out = _child(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a record
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
    print(json.dumps(out), flush=True)
    return 0


def _gpu_used(devs: list[dict]) -> float:
    return sum(d["total"] - d["free"] for d in devs if d["type"] == "gpu") / 2**30


def _child(spec: dict) -> dict:
    from hybrid.baselines import llama_offload as lo
    from hybrid.baselines.llama_runner import LlamaRunner, llama_cpp_info, require_llama_cpp

    if spec["what"] == "export":
        return export_gguf(spec["synth"], spec["gguf"])
    if spec["what"] == "info":
        llama_cpp = require_llama_cpp()
        try:
            import gguf  # noqa: F401 - the export child needs it (and PyYAML, which gguf imports)
            has_gguf = "ok"
        except ImportError as exc:
            has_gguf = f"missing: {exc}"
        return {"gguf": has_gguf, "llama_cpp": llama_cpp_info(), "devices": lo.devices(),
                "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()), "lib": str(lo._lib_dir()),
                "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}
    before = lo.devices()
    t = time.perf_counter()
    r = LlamaRunner(spec["gguf"], n_ctx=spec["n_ctx"], n_threads=spec["threads"], logits_all=False,
                    n_gpu_layers=spec["n_gpu_layers"], cpu_experts=spec["cpu_experts"], use_mmap=spec["use_mmap"])
    load_s = time.perf_counter() - t
    after = lo.devices()
    try:      # one load, then every prompt length in turn (a warm-up generation before each)
        runs = [r.decode_speed(ids, spec["tokens"], spec["warmup"]) for ids in spec["prompts"]]
    finally:
        place = r.placement()
        r.close()
    return {"runs": runs, "load_s": round(load_s, 2), "placement": place, "threads": spec["threads"],
            "use_mmap": spec["use_mmap"], "gpu_used_gib_by_load": round(_gpu_used(after) - _gpu_used(before), 2),
            "n_ctx": spec["n_ctx"], "n_ubatch": spec["n_ctx"],   # LlamaRunner: n_batch = n_ubatch = n_ctx
            "flash_attn": False, "llama_cpp": llama_cpp_info()["llama_cpp_python"]}


# ---------------------------------------------------------------- parent parts

def llama_env(ctx: dict) -> None:
    d = run_child({"what": "info"}, ctx["env"], 120)
    ok = "error" not in d
    if ok and ctx["device"] == "cuda" and not any(x["type"] == "gpu" for x in d["devices"]):
        d["error"] = (f"llama.cpp lists no GPU device ({[x['name'] for x in d['devices']]}): a CPU-only "
                      f"wheel, or libcudart/libcublas .so.13 not found (LD_LIBRARY_PATH={d.get('ld_library_path')})")
    if ok and d.get("gguf") != "ok":
        d["error"] = f"gguf {d.get('gguf')}: carry the gguf and PyYAML wheels"
    ctx["llama_ok"] = "error" not in d
    record({"check": "llama_env", "ok": ctx["llama_ok"], **d})


def run_pytest(ctx: dict, args: list[str]) -> None:
    """CUDA tests of llama.cpp's placements (tests/test_llama_offload.py -m cuda) in the children's env."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, timeout=180, env=ctx["env"], cwd=ROOT)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    log("\n".join(tail))
    record({"check": "pytest_cuda_llama", "ok": p.returncode == 0, "rc": p.returncode, "args": args,
            "seconds": round(time.perf_counter() - t, 1), "summary": tail[-1] if tail else ""})


def make_synth(ctx: dict) -> None:
    path = ctx["synth"]
    t = time.perf_counter()
    if (path / "model.safetensors.index.json").is_file() and not ctx["fresh"]:
        log(f"reusing {path}")
    else:
        cmd = [sys.executable, str(ROOT / "tools" / "make_synthetic.py"), str(path), "--skew", str(ctx["skew"])]
        p = subprocess.run(cmd + (SMALL if ctx["small"] else []), capture_output=True, text=True)
        log((p.stdout.strip() + p.stderr.strip()[-2000:])[-3000:])
        if p.returncode:
            raise RuntimeError(f"make_synthetic exited {p.returncode}")
    record({"check": "synthetic_written", "path": str(path), "skew": ctx["skew"], "small": ctx["small"],
            "seconds": round(time.perf_counter() - t, 1),
            "gib": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30, 2)})


def export_gguf(synth: str, out: str) -> dict:
    """(in a child) the GGUF of the checkpoint, NVFP4 re-packed bit for bit; checks what it wrote."""
    import gguf

    from hybrid.baselines.gguf_export import export_gguf as export

    t = time.perf_counter()
    rep = export(synth, out, "bf16")
    secs = time.perf_counter() - t
    r = gguf.GGUFReader(out)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    types = {x.name: x.tensor_type.name for x in r.tensors}
    exps = sorted({v for k, v in types.items() if "_exps.weight" in k})
    return {"ok": arch == "qwen3moe" and exps == ["NVFP4"], "seconds": round(secs, 1), "path": out,
            "gib": round(Path(out).stat().st_size / 2**30, 2), "architecture": arch, "tensors": rep.n_tensors,
            "source_linears": rep.kinds, "expert_tensor_types": exps, "attn_q_type": types.get("blk.0.attn_q.weight"),
            "gguf_package": getattr(gguf, "__version__", None) or "gguf"}


def start_export(ctx: dict) -> None:
    """The export runs in the background (one core, ~2-3 min at the 30B shape) while hybrid loads;
    `finish_export` waits for it before anything is timed."""
    ctx["export"] = Child({"what": "export", "synth": str(ctx["synth"]), "gguf": str(ctx["gguf"])}, ctx["env"])
    log(f"GGUF export started in the background -> {ctx['gguf']}")


def finish_export(ctx: dict, deadline: float) -> None:
    job = ctx.pop("export", None)
    if job is None:
        return
    t = time.perf_counter()
    d = job.result(deadline - t)
    ctx["gguf_ok"] = bool(d.get("ok"))
    record({"check": "gguf_export", **d, "waited_s": round(time.perf_counter() - t, 1)})


def prompt(ctx: dict) -> None:
    from hybrid.bench.decode import prompt_ids
    from hybrid.model.config import ModelConfig
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(ctx["synth"])
    ctx["tok"] = Tokenizer(ctx["synth"], cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    ctx["prompts"] = [prompt_ids(ctx["tok"], n) for n in ctx["prompt_tokens"]]


LLAMA_RUNS = (("llama_cpu_experts", dict(n_gpu_layers=-1, cpu_experts=True, use_mmap=False),
               "experts on the CPU (--cpu-moe pattern), the rest on the GPU"),     # the must-show first
              ("llama_all_gpu", dict(n_gpu_layers=-1, cpu_experts=False, use_mmap=True),
               "every layer on the GPU (n_gpu_layers=-1)"))


def llama_runs(ctx: dict, deadline: float) -> None:
    finish_export(ctx, deadline)
    if not ctx.get("llama_ok") or not ctx.get("gguf_ok"):
        record({"check": "llama_runs", "skipped": "llama.cpp environment check or GGUF export failed (see "
                "llama_env, gguf_export)"})
        return
    n_ctx = max(ctx["prompt_tokens"]) + max(ctx["warmup"], ctx["tokens"]) + 8
    for label, kw, desc in LLAMA_RUNS:
        left = deadline - time.perf_counter()
        if left < 30:
            record({"check": label, "engine": "llama.cpp", "skipped": "device-time deadline"})
            continue
        log(f"llama.cpp: {desc}")
        spec = {"what": "decode", "gguf": str(ctx["gguf"]), "n_ctx": n_ctx, "threads": ctx["threads"],
                "prompts": ctx["prompts"], "tokens": ctx["tokens"], "warmup": ctx["warmup"], **kw}
        d = run_child(spec, ctx["env"], left + 60)          # a started run may finish past the budget
        runs = d.pop("runs", None) or [{}]
        for n, run in zip(ctx["prompt_tokens"], runs):
            ctx["results"][label, n] = record({"check": label, "engine": "llama.cpp", "description": desc,
                                               **d, **run})


def _load_gpu_runtime_check():
    """tools/gpu_runtime_check.py as a module: its expert-profile calibration is reused, not copied."""
    spec = importlib.util.spec_from_file_location("gpu_runtime_check", ROOT / "tools" / "gpu_runtime_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def store_info(cpu) -> dict:
    """The CPU expert store's memory backing and why (hugetlb / thp / normal: the CPU-expert rate depends on it)."""
    arena = getattr(getattr(cpu, "store", None), "arena", None)
    return {} if arena is None else {"store_backing": arena.backing, "store_backing_why": arena.why,
                                     "store_huge_fraction": arena.huge_fraction()}


def hybrid_runs(ctx: dict, deadline: float) -> None:
    import torch

    from hybrid.bench.decode import measure
    from hybrid.runtime import RuntimeOptions, open_session

    grc = _load_gpu_runtime_check()
    dev, tok, cuda = ctx["device"], ctx["tok"], ctx["device"] == "cuda"
    lengths, n = ctx["prompt_tokens"], (ctx["warmup"], ctx["tokens"])
    context = max(lengths) + max(n)
    common = dict(device=dev, profile=ctx["profile"], cpu_threads=ctx["threads"])
    log("hybrid: every expert on the CPU runner (builds the expert store)")
    s0 = open_session(ctx["synth"], RuntimeOptions(gpus=(0,), cache_slots=(0,), **common), context=context)
    cpu = s0.cpu
    try:
        prof = OUT / "synth30.experts.json"
        try:
            grc.calibrate_profile(s0, tok, ctx["synth"], prof)
            finish_export(ctx, deadline + 120)   # nothing is timed while the export runs
            for length in lengths:
                rec = measure(s0, tok, length, *n)
                ctx["results"]["hybrid_all_cpu", length] = record({
                    "check": "hybrid_all_cpu", "engine": "hybrid", "flags": "--gpus 0 --cache-slots 0 --profile "
                    f"{ctx['profile']} --cpu-threads {ctx['threads']}", **rec, "threads": ctx["threads"],
                    "prefill_chunk": s0.prefill_chunk, **grc.graph_info(s0), **store_info(cpu)})
        finally:
            s0.owns_cpu = False                  # the runner serves the next session; closed at the end
            s0.close()
            del s0
            torch.cuda.empty_cache() if cuda else None
        if time.perf_counter() > deadline:
            record({"check": "hybrid_cap16", "engine": "hybrid", "skipped": "device-time deadline"})
            return
        log("hybrid: --gpus 0,0 --vram-cap 16")
        torch.cuda.reset_peak_memory_stats() if cuda else None
        s = open_session(ctx["synth"], RuntimeOptions(gpus=(0, 0), vram_cap_gib=(16.0,), expert_profile=str(prof),
                                                      **common), context=context, cpu=cpu)
        try:
            for length in lengths:
                rec = measure(s, tok, length, *n)
                vram = round(torch.cuda.max_memory_allocated(0) / 2**30, 2) if cuda else None
                ctx["results"]["hybrid_cap16", length] = record({
                    "check": "hybrid_cap16", "engine": "hybrid", "flags": "--gpus 0,0 --vram-cap 16 --profile "
                    f"{ctx['profile']} --expert-profile synth30.experts.json --cpu-threads {ctx['threads']}",
                    **rec, "threads": ctx["threads"], "peak_gib_both_cards": vram, "prefill_chunk": s.prefill_chunk,
                    "full_layers": [len(c.full) for c in s.cards], **grc.graph_info(s)})
        finally:
            s.close()
            torch.cuda.empty_cache() if cuda else None
    finally:
        cpu.close()                              # llama.cpp runs next: no hybrid threads or VRAM left


# ---------------------------------------------------------------- table

ROWS = (("llama_all_gpu", "llama.cpp", "all layers on the GPU", "GPU"),
        ("llama_cpu_experts", "llama.cpp", "`n_gpu_layers=-1` + `ffn_*_exps` on the CPU", "CPU"),
        ("hybrid_all_cpu", "hybrid", "1 card, `--cache-slots 0`", "CPU (runner)"),
        ("hybrid_cap16", "hybrid", "`--gpus 0,0 --vram-cap 16`", "GPU slots (+ CPU misses)"))


def table(results: dict, lengths: list[int]) -> str:
    """One row per (engine and placement, prompt length); results keyed by (check, prompt tokens), so a length
    given twice shows its last measurement (the JSONL keeps both)."""
    lines = ["| prompt | engine | placement | experts on | decode tok/s | prefill tok/s | planner tok/s at the "
             "measured context | measured / predicted | VRAM GiB | leading greedy ids = hybrid all-CPU's (first 16 "
             "compared) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n, (key, engine, place, where) in ((n, row) for n in dict.fromkeys(lengths) for row in ROWS):
        ref = results.get(("hybrid_all_cpu", n), {}).get("generated_ids_head") or []
        r = results.get((key, n))
        if r is None or "decode_tok_s" not in r:
            why = (r or {}).get("skipped") or ((r or {}).get("error") or "not run")[:80]
            lines.append(f"| {n} | {engine} | {place} | {where} | – ({why}) | | | | | |")
            continue
        pred = r.get("prediction", {}).get("tok_s_at_measured_context")
        vram = r.get("gpu_used_gib_by_load", r.get("peak_gib_both_cards"))
        ids = r.get("generated_ids_head") or []
        lines.append(f"| {n} | {engine} | {place} | {where} | **{r['decode_tok_s']:.2f}** | {r['prefill_tok_s']:.1f} | "
                     f"{'' if pred is None else f'{pred:.2f}'} | "
                     f"{r.get('measured_over_predicted_at_context', '')} | "
                     f"{'' if vram is None else vram} | {_load_gpu_runtime_check().prefix_match(ids, ref) if ref else ''} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", default=None, help="folder with llama_cpp, gguf, ... (pip --target): first on the "
                   "PYTHONPATH and LD_LIBRARY_PATH of the child processes (the parent, which runs hybrid, needs none)")
    p.add_argument("--synth", type=Path, default=Path("/tmp/synth30"))
    p.add_argument("--gguf", type=Path, default=None, help="GGUF path (default: <synth>.gguf)")
    p.add_argument("--skew", type=float, default=0.25)
    p.add_argument("--prompt-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[32],
                   help="prompt length(s), comma list (default 32): each engine loads once and runs every length")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp n_threads and hybrid --cpu-threads "
                   "(default: physical cores)")
    p.add_argument("--profile", default="h200", help="hardware profile for hybrid's planner (default h200)")
    p.add_argument("--budget-s", type=float, default=450, help="start no new part after this many seconds")
    p.add_argument("--llama-reserve-s", type=float, default=120,
                   help="hybrid starts no new session when fewer seconds than this are left before the budget ends")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (the device call) or cpu (dry run)")
    p.add_argument("--small", action="store_true", help="a small synthetic shape (dry run)")
    p.add_argument("--fresh", action="store_true", help="rewrite the checkpoint even if --synth holds one")
    p.add_argument("--pytest", default="", help="test files to run with -m cuda in the children's env first, "
                   "space-separated (e.g. tests/test_llama_offload.py)")
    p.add_argument("--skip", default="", help="parts to skip, comma list: llama,hybrid")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    OUT.mkdir(parents=True, exist_ok=True)
    from hybrid.hardware import physical_cores

    ctx = {"device": a.device, "synth": a.synth, "gguf": a.gguf or a.synth.with_suffix(".gguf"), "skew": a.skew,
           "small": a.small, "fresh": a.fresh, "prompt_tokens": a.prompt_tokens, "warmup": a.warmup,
           "tokens": a.tokens, "threads": a.threads or physical_cores(), "profile": a.profile,
           "env": child_env(a.site), "results": {}}
    deadline = T0 + a.budget_s
    skip = set(filter(None, a.skip.split(",")))
    log(subprocess.run(["nvidia-smi" if a.device == "cuda" else "true", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
    log(f"threads {ctx['threads']}; children: LD_LIBRARY_PATH={ctx['env'].get('LD_LIBRARY_PATH', '')}")
    parts = [("llama_env", lambda: llama_env(ctx))]
    parts += [("pytest", lambda: run_pytest(ctx, a.pytest.split()))] if a.pytest else []
    parts += [("synthetic", lambda: make_synth(ctx)),
             ("gguf_export", lambda: start_export(ctx)), ("prompt", lambda: prompt(ctx))]
    parts += [] if "hybrid" in skip else [("hybrid", lambda: hybrid_runs(ctx, deadline - a.llama_reserve_s))]
    parts += [] if "llama" in skip else [("llama", lambda: llama_runs(ctx, deadline))]
    _load_gpu_runtime_check().run_parts(parts, deadline, record, log)
    finish_export(ctx, 60)
    text = table(ctx["results"], ctx["prompt_tokens"])
    (OUT / "llama_ab.md").write_text(text + "\n")
    print(text)
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

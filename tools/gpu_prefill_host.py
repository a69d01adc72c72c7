"""Where a short prompt's prefill goes, every expert resident on the card (no CPU runner), on the
Qwen3-30B-A3B-shaped synthetic NVFP4 checkpoint. Writes $OUT/prefill_host.jsonl + gpu_check.log.

Per --prompt-tokens size and --modes item (eager: HybridModel's eager prefill; graph: the prefill graphs
of hybrid.runtime.prefill_graphs, where the prompt fits a bucket): the prefill forward (HybridModel.forward of the whole prompt into a fresh
KV cache, last row's logits, then a device sync) timed over --repeats runs after a warm-up: wall ms
(median, min), and the host's own share: the wall time of the forward call before its sync (the host
enqueueing) and the sync's wait. For the sizes in --profile-sizes, one more forward under cProfile (host
functions by own time, per forward) and one under torch.profiler (kernel launches and GPU busy time
summed over the kernels and copies, the top GPU kernels). A forward whose host enqueue time is close
to its wall time is host-bound: the GPU idles between launches.

    HYBRID_CACHE_DIR=.qpncache HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_prefill_host.py \\
        --prompt-tokens 8,16,32,64,128,512 --modes eager,graph --profile-sizes 32 --budget-s 150

--small: a 4-layer toy checkpoint; --device cpu: the same on a machine without a GPU (smoke).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode_overlap_ab as oa  # noqa: E402  - synth_args / synth_parts / uniform_profile / NoCpuRunner
import gpu_runtime_check as rc  # noqa: E402  - log / recorder / run_parts / top_functions

rc.OUT = oa.OUT = OUT = Path(os.environ.get("OUT", "scratch/out"))
JSONL = "prefill_host.jsonl"
record = rc.recorder("tools/gpu_prefill_host.py", JSONL,
                     ("prompt_tokens", "wall_ms", "host_ms", "prefill_tok_s", "launches", "gpu_busy_ms",
                      "skipped", "error"))
rc.record = oa.record = record


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def forward_once(hm, ids, dev, chunk: int = 0) -> tuple[float, float]:
    """One prefill of ids into a fresh cache, in steps of `chunk` tokens (0: one step) as generate() runs a
    long prompt -> (wall s, host enqueue s)."""
    from hybrid.generate import prefill

    hm.new_cache(len(ids) + 8)
    _sync(dev)
    t0 = time.perf_counter()
    prefill(hm, ids, chunk)
    t1 = time.perf_counter()
    _sync(dev)
    return time.perf_counter() - t0, t1 - t0


def gpu_profile(hm, ids, dev, top: int = 12, chunk: int = 0) -> dict:
    """One forward under torch.profiler: launches, GPU busy ms (kernels + copies), the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        forward_once(hm, ids, dev, chunk)
    launches, busy, kernels = 0, 0.0, []
    for e in prof.key_averages():
        if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += e.count
        dt = getattr(e, "self_device_time_total", 0.0) or 0.0
        if dt and e.device_type == torch.autograd.DeviceType.CUDA:
            busy += dt
            kernels.append((e.key[:60], round(dt / 1e3, 3), e.count))
    kernels.sort(key=lambda r: -r[1])
    return {"launches": launches, "gpu_busy_ms": round(busy / 1e3, 3), "top_gpu": kernels[:top]}


def route_stats(hm, ids, dev, cfg) -> None:
    """One eager prefill with the router observed: how evenly the prompt's rows fall on the experts (the
    grouped MoE kernels' block rows are experts: the busiest one sets a layer's time)."""
    import numpy as np

    counts = np.zeros((cfg.num_hidden_layers, cfg.num_experts), dtype=np.int64)
    inner = hm.model
    inner.on_route = lambda l, r, w: np.add.at(counts[l], r.cpu().numpy().ravel(), 1)
    try:
        forward_once(hm, ids, dev)
    finally:
        inner.on_route = None
    mean = len(ids) * cfg.num_experts_per_tok / cfg.num_experts
    top = counts.max(axis=1)
    record({"check": f"route_{len(ids)}", "prompt_tokens": len(ids), "rows_mean": round(mean, 2),
            "rows_max_median": float(np.median(top)), "rows_max_max": int(top.max()),
            "rows_max_over_mean": round(float(np.median(top)) / mean, 2),
            "active_experts_median": float(np.median((counts > 0).sum(axis=1))),
            "top8_share_median": round(float(np.median(np.sort(counts, axis=1)[:, -8:].sum(axis=1)
                                                        / counts.sum(axis=1))), 3)})


def runs(path: Path, deadline: float, a) -> None:
    import cProfile

    import torch

    from hybrid.bench.decode import prompt_ids
    from hybrid.kernels import qpn
    from hybrid.model.config import ModelConfig
    from hybrid.runtime import RuntimeOptions, open_session
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    slots = cfg.num_hidden_layers * cfg.num_experts
    opts = RuntimeOptions(device=a.device, gpus=(0,), cache_slots=(slots,), expert_profile=str(oa.uniform_profile(path)),
                          profile=a.profile if a.device == "cuda" else None, prefill_offload_min=0)
    s = open_session(path, opts, context=max(a.prompt_tokens) + 16, cpu=oa.NoCpuRunner())
    try:
        hm, dev = s.model, s.placement.cards[0].device
        dev = torch.device(dev)
        record({"check": "session", "slots": slots, "load_s": {k: round(v, 2) for k, v in s.load_s.items()},
                "placement": s.placement.describe()})
        pg = hm.prefill_graphs
        if pg is not None and a.graph_max:
            pg.hi = a.graph_max
        rules = dict(qpn.MOE_GEMM_RULES)
        if a.route_stats:
            for n in a.prompt_tokens:
                route_stats(hm, prompt_ids(tok, n), dev, cfg)
        combos = [(mode, g, st) for mode in a.modes for g in a.moe_gemm for st in a.settle]
        ex, marks_only = hm.experts, hm.experts._marks_only
        for n, mode, g, st, pas in [(n, mode, g, st, pas) for n in a.prompt_tokens for pas in range(a.passes)
                                    for mode, g, st in (combos if pas % 2 == 0 else combos[::-1])]:
            check = (f"prefill_{n}_{mode}" + (f"_moegemm{g}" if len(a.moe_gemm) > 1 else "")
                     + (f"_settle{st}" if len(a.settle) > 1 else ""))
            ex._marks_only = marks_only if st == "marks" else (lambda pairs: False)
            if time.perf_counter() > deadline:
                record({"check": check, "prompt_tokens": n, "skipped": "device-time deadline"})
                continue
            if pg is not None:
                pg.enabled, pg.chunks = mode != "eager", mode == "graphc"
            qpn.MOE_GEMM[0], _, bm64 = g.partition("@")
            qpn.MOE_GEMM_RULES.update({key: (least, int(bm64) if bm64 else default)
                                       for key, (least, default) in rules.items()})
            ids = prompt_ids(tok, n)
            steps0 = pg.steps if pg is not None else 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(2):
                forward_once(hm, ids, dev, a.chunk)              # warm-up: compiles, allocator, captures
            walls, hosts = zip(*(forward_once(hm, ids, dev, a.chunk) for _ in range(a.repeats)))
            wall, host = statistics.median(walls), statistics.median(hosts)
            rec = {"check": check, "mode": mode, "moe_gemm": g, "settle": st, "pass": pas, "prompt_tokens": len(ids),
                   "chunk": a.chunk,
                   "repeats": a.repeats,
                   "graphed_steps": (pg.steps - steps0) if pg is not None else 0,
                   "captures": pg.captures if pg is not None else 0,
                   "graph_error": pg.error if pg is not None else None,
                   "wall_ms": round(wall * 1e3, 3), "wall_min_ms": round(min(walls) * 1e3, 3),
                   "host_ms": round(host * 1e3, 3), "prefill_tok_s": round(len(ids) / wall, 1),
                   "per_layer_wall_us": round(wall / cfg.num_hidden_layers * 1e6, 1)}
            if dev.type == "cuda":   # the graphs' pools show in the allocator's reserve and the card's use
                free, total = torch.cuda.mem_get_info(dev)
                rec.update(reserved_mib=round(torch.cuda.memory_reserved(dev) / 2**20, 1),
                           peak_allocated_mib=round(torch.cuda.max_memory_allocated(dev) / 2**20, 1),
                           card_used_mib=round((total - free) / 2**20, 1))
            if n in a.profile_sizes:
                prof = cProfile.Profile()
                prof.enable()
                forward_once(hm, ids, dev, a.chunk)
                prof.disable()
                rec["host_top"] = rc.top_functions(prof, 1, 25)
                rec.update(gpu_profile(hm, ids, dev, chunk=a.chunk))
            record(rec)
    finally:
        s.close()


def _ints(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"error: {flag} {text}: expected a comma-separated list of integers >= 1")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    oa.synth_args(p)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the tool here")
    p.add_argument("--profile", default="h200")
    p.add_argument("--prompt-tokens", default="8,16,32,64,128,512")
    p.add_argument("--modes", default="eager,graph", help="comma list of eager | graph | graphc (graph, and a "
                   "chunked prompt's later chunks through graphs too: HYBRID_PREFILL_GRAPH_CHUNKS), measured in "
                   "turn per size")
    p.add_argument("--chunk", type=int, default=0, help="prefill a prompt in steps of this many tokens, as "
                   "hybrid-run's --prefill-chunk (default 0: one step)")
    p.add_argument("--moe-gemm", default="auto", help="comma list of HYBRID_MOE_GEMM values (auto, 0, 1, f; "
                   "'auto@64': BM 64 from 64 rows in every family) alternated per size in one session; a graphed "
                   "bucket keeps the kernels of its capture, so compare them in eager mode")
    p.add_argument("--settle", default="marks", help="comma list of marks | ids: how a step's resident layers' "
                   "routing reaches the cache's counters (marks: the default, a prefill's expert sets marked on the "
                   "card; ids: every routed id copied)")
    p.add_argument("--route-stats", action="store_true", help="per size, one prefill with the routing counted "
                   "(rows per expert: mean, busiest)")
    p.add_argument("--graph-max", type=int, default=0, help="the largest prefill-graph bucket (default: "
                   "hybrid.runtime.prefill_graphs.PREFILL_GRAPH_MAX)")
    p.add_argument("--passes", type=int, default=1, help="run the mode x moe-gemm list this many times, "
                   "every second pass in reverse order")
    p.add_argument("--profile-sizes", default="32", help="sizes also run under cProfile and torch.profiler")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=150, help="stop starting new sizes after this")
    a = p.parse_args()
    a.prompt_tokens = _ints("--prompt-tokens", a.prompt_tokens)
    a.profile_sizes = set(_ints("--profile-sizes", a.profile_sizes))
    a.modes = [x.strip() for x in a.modes.split(",") if x.strip()]
    if not a.modes or any(x not in ("eager", "graph", "graphc") for x in a.modes):
        raise SystemExit(f"error: --modes {','.join(a.modes)}: expected a comma list of eager, graph, graphc")
    if a.chunk < 0:
        raise SystemExit(f"error: --chunk {a.chunk}: expected >= 0")
    a.moe_gemm = [x.strip() for x in a.moe_gemm.split(",") if x.strip()]
    if not a.moe_gemm or any(x.partition("@")[0] not in ("auto", "0", "1", "f")
                             or not (x.partition("@")[2] or "0").isdigit() for x in a.moe_gemm):
        raise SystemExit(f"error: --moe-gemm {','.join(a.moe_gemm)}: expected a comma list of auto, 0, 1, f (auto@N: BM 64 from N rows)")
    a.settle = [x.strip() for x in a.settle.split(",") if x.strip()]
    if not a.settle or any(x not in ("marks", "ids") for x in a.settle):
        raise SystemExit(f"error: --settle {','.join(a.settle)}: expected a comma list of marks, ids")
    if a.passes < 1:
        raise SystemExit(f"error: --passes {a.passes}: expected >= 1")
    if a.repeats < 1:
        raise SystemExit(f"error: --repeats {a.repeats}: expected >= 1")
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = rc.T0 + a.budget_s
    parts = oa.synth_parts(a) + [("prefill_runs", lambda: runs(a.synth, deadline, a))]
    rc.run_parts(parts, deadline, record, rc.log)
    rc.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

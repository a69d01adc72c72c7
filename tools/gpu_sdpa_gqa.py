"""Prefill attention's memory and time on a GPU, GQA through enable_gqa vs stride-0 expanded keys
(hybrid.model.layers.gqa_attention), with torch's default SDPA backends and with the set a Volta card has
(memory-efficient + math: no flash attention, which alone takes enable_gqa), on 30B-A3B shapes
(Hq 32, Hkv 4, D 128, fp16): a prompt's first step (is_causal) and later chunks (lower-right causal bias).

Per (T, P, backends, path): the allocator's peak above what was allocated before the call (the score
matrix, if a backend builds one), the median time of --repeats calls (CUDA events) and the largest
difference from the default backends' enable_gqa output. Records to $OUT/sdpa_gqa.jsonl.

    HYBRID_GIT_SHA=<sha> PYTHONPATH=. python3 tools/gpu_sdpa_gqa.py
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybrid.baselines.report import append_jsonl, stamp  # noqa: E402
from hybrid.model.layers import prefill_attention  # noqa: E402

OUT = Path(os.environ.get("OUT", "scratch/out"))
BACKENDS = {"default": None, "volta": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            "efficient_only": [SDPBackend.EFFICIENT_ATTENTION]}


def attend(q, ks, vs, t: int, p: int) -> torch.Tensor:
    """What Attention._cuda does for T queries at position p over the cache's rows 0 .. p + T - 1."""
    return prefill_attention(q, ks[: p + t], vs[: p + t], p)


def run(t: int, p: int, backend: str, path: str, ref, repeats: int, hq: int, hkv: int, d: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(t + p)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.float16, generator=g)
    ks, vs = (torch.randn(p + t, hkv, d, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
    os.environ["HYBRID_SDPA_GQA"] = path
    rec = {"check": "sdpa_gqa", "t": t, "p": p, "backends": backend, "path": path, "hq": hq, "hkv": hkv, "d": d}
    try:
        with sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] else contextlib.nullcontext():
            attend(q, ks, vs, t, p)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = attend(q, ks, vs, t, p)
            torch.cuda.synchronize()
            rec["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                attend(q, ks, vs, t, p)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000)
        rec["us"] = round(statistics.median(times), 1)
        if ref is not None:
            rec["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
        rec["out"] = out
    except RuntimeError as exc:
        rec["error"] = str(exc).splitlines()[0][:300]
    finally:
        os.environ.pop("HYBRID_SDPA_GQA", None)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096:0,2048:0,512:3584,2048:2048", help="T:P pairs, comma list")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    st = stamp("tools/gpu_sdpa_gqa.py")
    if os.environ.get("HYBRID_GIT_SHA"):
        st["git_sha"] = os.environ["HYBRID_GIT_SHA"]
    st["gpu"] = torch.cuda.get_device_name()
    recs = []
    for shape in a.shapes.split(","):
        t, p = (int(x) for x in shape.split(":"))
        ref = None
        for backend in BACKENDS:
            for path in ("native", "expand"):
                r = run(t, p, backend, path, ref, a.repeats, 32, 4, 128)
                out = r.pop("out", None)
                if ref is None and out is not None:
                    ref = out
                recs.append({**r, **st})
                print(json.dumps({k: v for k, v in r.items() if k not in ("hq", "hkv", "d", "check")}), flush=True)
                del out
                torch.cuda.empty_cache()
    append_jsonl(OUT / "sdpa_gqa.jsonl", recs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

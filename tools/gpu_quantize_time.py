"""hybrid-quantize on the CPU against --device cuda (issue 5's follow-up of the thirty-fifth session): a random BF16
checkpoint with Qwen3-30B-A3B's layer shapes (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768; --layers of
them, a 4096-token vocabulary), quantized with each --recipe and NVFP4 scale choice on each device, in turn; per run
the wall time (hybrid.cli.quantize.main in this process) and whether the GPU's files equal the CPU's byte for byte.

    PYTHONPATH=. python3 tools/gpu_quantize_time.py --work /tmp/qtime --layers 2 --out $OUT/quantize_time.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from hybrid.cli.quantize import main as quantize
from hybrid.testing import write_random_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/qtime")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", default="nvfp4:amax,nvfp4:mse,mixed:mse")
    ap.add_argument("--out", default="quantize_time.jsonl")
    ap.add_argument("--sha", default=os.environ.get("HYBRID_GIT_SHA", "unknown"))
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    t = time.perf_counter()
    src = write_random_model(work / "src", "qwen3_moe", seed=1, hidden_size=2048, num_hidden_layers=a.layers,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                             num_experts=128, num_experts_per_tok=8, vocab_size=4096)
    made = time.perf_counter() - t
    out = open(a.out, "a")
    src_gib = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**30
    head = {"what": "gpu_quantize_time", "git_sha": a.sha, "command": " ".join(["tools/gpu_quantize_time.py", *sys.argv[1:]]),
            "gpu": torch.cuda.get_device_name(0), "cpu_threads": torch.get_num_threads(),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
            "source_gib": round(src_gib, 3), "source_written_s": round(made, 1)}
    print(json.dumps(head), flush=True)
    out.write(json.dumps(head) + "\n")
    for run in a.runs.split(","):
        recipe, scales = run.split(":")
        dirs = {}
        for dev in ("cpu", "cuda"):
            dst = work / f"{recipe}-{scales}-{dev}"
            t = time.perf_counter()
            rc = quantize([str(src), str(dst), "--recipe", recipe, "--nvfp4-scales", scales, "--device", dev,
                           "--no-progress"])
            dt = time.perf_counter() - t
            dirs[dev] = dst
            r = {"recipe": recipe, "scales": scales, "device": dev, "rc": rc, "seconds": round(dt, 2),
                 "source_gb_per_s": round(src_gib * 2**30 / dt / 1e9, 3)}
            print(json.dumps(r), flush=True)
            out.write(json.dumps(r) + "\n")
        files = sorted(f.name for f in dirs["cpu"].glob("*.safetensors"))
        same = all((dirs["cpu"] / f).read_bytes() == (dirs["cuda"] / f).read_bytes() for f in files)
        r = {"recipe": recipe, "scales": scales, "files": len(files), "cuda_bytes_equal_cpu": same}
        print(json.dumps(r), flush=True)
        out.write(json.dumps(r) + "\n")
        for d in dirs.values():
            shutil.rmtree(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())

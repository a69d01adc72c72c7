"""Device check (issue 4/7): why is all-CPU decode far below the CPU runner's throughput?
(a) the runner alone on cold layer calls (48 layers x 8 random experts, M = 1), parts 16/15/12/8
(b) all-CPU decode (GPU dense, every expert on the CPU runner) at the same part counts.
Needs /tmp/synth30 (tools/gpu_runtime_check.py writes it). JSON lines on stdout."""
import json
import os
import sys
import time

import numba
import numpy as np
import torch

from gpu_cpu_handoff import open_all_cpu, runner_alone      # tools/ is on sys.path when run as a script
from hybrid.bench.decode import measure

path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/synth30"
s, cfg, tok = open_all_cpu(path)
runner = s.cpu.runner
print(json.dumps({"threading_layer": numba.threading_layer() if hasattr(numba, "threading_layer") else None,
                  "numba_threads": numba.config.NUMBA_NUM_THREADS, "runner_threads": runner.threads,
                  "omp": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}), flush=True)


def thp():
    for line in open("/proc/meminfo"):
        if line.startswith(("AnonHugePages", "HugePages_Total")):
            print(json.dumps({"meminfo": line.strip(), "t": round(time.perf_counter(), 1)}), flush=True)


thp()
print(json.dumps({"store_backing": getattr(runner.store, "backing", None)}), flush=True)
rng = np.random.default_rng(0)
x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
gb = cfg.num_hidden_layers * cfg.num_experts_per_tok * runner.store.slot_nbytes / 1e9
for parts in (16, 15, 12, 8, 16):
    runner.threads = parts
    for rnd in range(3):
        dt = runner_alone(runner, cfg, rng, x)
    print(json.dumps({"check": "runner_alone", "parts": parts, "ms_per_token": round(dt * 1e3, 2),
                      "gb_s": round(gb / dt, 2), "gb_per_token": round(gb, 3), "t": round(time.perf_counter(), 1)}), flush=True)
    thp()
for parts in (16, 15, 12, 8):
    runner.threads = parts
    rec = measure(s, tok, 32, 4, 16)
    print(json.dumps({"check": "all_cpu_decode", "parts": parts, "decode_tok_s": rec["decode_tok_s"],
                      **{k2: rec.get(k2) for k2 in ("cpu_expert_ms_per_token", "cpu_wait_ms_per_token",
                                                     "route_sync_ms_per_token")}}), flush=True)
s.close()

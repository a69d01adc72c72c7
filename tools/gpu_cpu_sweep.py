"""Device check (issue 4/7): why is all-CPU decode far below the CPU runner's throughput?
(a) the runner alone on cold layer calls (48 layers x 8 random experts, M = 1), parts 16/15/12/8
(b) all-CPU decode (GPU dense, every expert on the CPU runner) at the same part counts.
Needs /tmp/synth30 (tools/gpu_runtime_check.py writes it). JSON lines on stdout."""
import json, os, sys, time
import numpy as np
import torch
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.tokenizer import Tokenizer
from hybrid.bench.decode import measure

path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/synth30"
cfg = ModelConfig.from_folder(path)
tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
s = open_session(path, RuntimeOptions(device=os.environ.get("DEV", "cuda"), gpus=(0,), cache_slots=(0,), profile="h200"), context=96)
runner = s.cpu.runner
import numba
print(json.dumps({"threading_layer": numba.threading_layer() if hasattr(numba, "threading_layer") else None,
                  "numba_threads": numba.config.NUMBA_NUM_THREADS, "runner_threads": runner.threads,
                  "omp": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}), flush=True)
def thp():
    for line in open("/proc/meminfo"):
        if line.startswith(("AnonHugePages", "HugePages_Total")):
            print(json.dumps({"meminfo": line.strip(), "t": round(time.perf_counter(), 1)}), flush=True)
thp()
print(json.dumps({"store_backing": getattr(runner.store, "backing", None)}), flush=True)
st = runner.store
rng = np.random.default_rng(0)
L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
for parts in (16, 15, 12, 8, 16):
    runner.threads = parts
    for rnd in range(3):
        t0 = time.perf_counter()
        for l in range(L):
            ids = sorted(rng.choice(E, k, replace=False).tolist())
            h = runner.submit(l, ids, [np.array([0])] * k, [np.array([1 / k], np.float32)] * k, x)
            runner.sync(h)
        dt = time.perf_counter() - t0
    gb = L * k * st.slot_nbytes / 1e9
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

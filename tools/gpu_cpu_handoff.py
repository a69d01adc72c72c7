"""Device check (issue 4/7): all-CPU decode (GPU dense, every expert on the CPU runner) under hand-off settings:
the GIL switch interval and torch's intra-op threads. Needs /tmp/synth30. JSON lines on stdout."""
import json, sys, time
import numpy as np
import torch
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.tokenizer import Tokenizer
from hybrid.bench.decode import measure

import os
path = sys.argv[1]
print(json.dumps({"env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")}}), flush=True)
cfg = ModelConfig.from_folder(path)
tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
s = open_session(path, RuntimeOptions(device="cuda", gpus=(0,), cache_slots=(0,), profile="h200"), context=96)
runner = s.cpu.runner
rng = np.random.default_rng(0)
L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
t0 = time.perf_counter()
for l in range(L):
    ids = sorted(rng.choice(E, k, replace=False).tolist())
    runner.sync(runner.submit(l, ids, [np.array([0])] * k, [np.array([1 / k], np.float32)] * k, x))
print(json.dumps({"check": "runner_alone", "ms_per_token": round((time.perf_counter() - t0) * 1e3, 2)}), flush=True)
nt = torch.get_num_threads()
for label, sw, th in (("base", 0.005, nt), ("switch_0.2ms", 0.0002, nt), ("torch_1_thread", 0.005, 1),
                      ("both", 0.0002, 1), ("base_again", 0.005, nt)):
    sys.setswitchinterval(sw)
    torch.set_num_threads(th)
    rec = measure(s, tok, 32, 4, 24)
    print(json.dumps({"check": "all_cpu_decode", "setting": label, "decode_tok_s": rec["decode_tok_s"],
                      **{k2: rec.get(k2) for k2 in ("cpu_expert_ms_per_token", "cpu_wait_ms_per_token",
                                                     "route_sync_ms_per_token")}}), flush=True)
s.close()

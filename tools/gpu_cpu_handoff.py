"""Device check (issue 4/7): all-CPU decode (GPU dense, every expert on the CPU runner) against the
runner alone, to find where the decode loses time. Needs a 30B-A3B-shaped checkpoint (tools/make_synthetic.py).

1. the runner alone: 48 layers x 8 uniform random experts, random activations, calls back to back
2. all-CPU decode; the runner's own timing (submit -> start: queue_ms, kernel_ms) per token, and every
   call the decode made captured (layer, experts, rows, weights, activations)
3. the captured calls replayed back to back through the same runner (the decode's data without the
   decode around it): as fast as (1) -> the hand-off/environment costs the time; as slow as (2) -> the data

    PYTHONPATH=. python3 tools/gpu_cpu_handoff.py /tmp/synth30        # JSON lines on stdout
"""
import json
import os
import sys
import time

import numpy as np

from hybrid.bench.decode import measure
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.tokenizer import Tokenizer


def per_token(runner, a, tokens):
    b = runner.timing
    return {"calls": b["calls"] - a["calls"],
            "queue_ms_per_token": round(1e3 * (b["queue_s"] - a["queue_s"]) / tokens, 2),
            "kernel_ms_per_token": round(1e3 * (b["kernel_s"] - a["kernel_s"]) / tokens, 2)}


def open_all_cpu(path: str):
    """-> (session with every expert on the CPU runner and dense layers on $DEV (default cuda), config, tokenizer)."""
    cfg = ModelConfig.from_folder(path)
    tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    s = open_session(path, RuntimeOptions(device=os.environ.get("DEV", "cuda"), gpus=(0,), cache_slots=(0,),
                                          profile="h200"), context=96)
    return s, cfg, tok


def runner_alone(runner, cfg, rng, x) -> float:
    """Seconds for one token's calls back to back: every layer, k uniform random experts, M = 1."""
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    t0 = time.perf_counter()
    for layer in range(L):
        ids = sorted(rng.choice(E, k, replace=False).tolist())
        runner.sync(runner.submit(layer, ids, [np.array([0])] * k, [np.array([1 / k], np.float32)] * k, x))
    return time.perf_counter() - t0


def main() -> None:
    path = sys.argv[1]
    print(json.dumps({"env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}), flush=True)
    s, cfg, tok = open_all_cpu(path)
    runner, L = s.cpu.runner, cfg.num_hidden_layers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    for rep in range(2):
        a = dict(runner.timing)
        dt = runner_alone(runner, cfg, rng, x)
        print(json.dumps({"check": "runner_alone", "rep": rep, "ms_per_token": round(dt * 1e3, 2),
                          **per_token(runner, a, 1)}), flush=True)

    calls, submit = [], runner.submit

    def capture(layer, expert_ids, token_rows, route_weights, xx):
        calls.append((layer, np.array(expert_ids), np.array(token_rows), np.array(route_weights), np.array(xx)))
        return submit(layer, expert_ids, token_rows, route_weights, xx)

    tokens = 24
    a = dict(runner.timing)
    runner.submit = capture
    rec = measure(s, tok, 32, 4, tokens)
    runner.submit = submit
    print(json.dumps({"check": "all_cpu_decode", "decode_tok_s": rec["decode_tok_s"],
                      "cpu_expert_ms_per_token": rec.get("cpu_expert_ms_per_token"),
                      "note": "runner timing over warm-up + prefill + measured tokens", **per_token(runner, a, 1),
                      "captured_calls": len(calls)}), flush=True)
    decode_calls = [c for c in calls if c[4].shape[0] == 1][-L * 16:]          # the last 16 tokens' calls
    for rep in range(2):
        a, t0 = dict(runner.timing), time.perf_counter()
        for c in decode_calls:
            runner.sync(runner.submit(*c))
        n_tok = len(decode_calls) / L
        print(json.dumps({"check": "replay_decode_calls", "rep": rep, "tokens": n_tok,
                          "ms_per_token": round((time.perf_counter() - t0) * 1e3 / n_tok, 2),
                          **per_token(runner, a, n_tok)}), flush=True)
    xs = np.stack([c[4][0] for c in decode_calls])
    tiny = np.abs(xs)[np.abs(xs) > 0].min() if (xs != 0).any() else 0.0
    print(json.dumps({"check": "decode_activations", "abs_max": float(np.abs(xs).max()), "abs_min_nonzero": float(tiny),
                      "experts_per_call": float(np.mean([len(np.unique(c[1])) for c in decode_calls]))}), flush=True)
    s.close()


if __name__ == "__main__":
    main()

"""First generation after load with the overlapped decode's embedding table pinned at load (the session's
DecodeGraphs.pin_embed, "load") or at the first step that runs ahead (the session's call skipped, "first_step": the
earlier behaviour), sessions alternating; every expert resident on GPU 0 (results/runtime.md section 47).

    PYTHONPATH=. python3 tools/make_synthetic.py /tmp/synth8 --skew 0.25 --layers 8
    PYTHONPATH=. python3 tools/gpu_embed_pin_ab.py /tmp/synth8

(8 layers of the Qwen3-30B-A3B-shaped synthetic checkpoint: its 151936 x 2048 table, a short load.) Per session: load
time and parts (load_s: "embed" is the pin), the first and a second 64-token greedy generation's decode time.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

from hybrid.generate import generate
from hybrid.model import ModelConfig
from hybrid.runtime import open_session
from hybrid.runtime.graphs import DecodeGraphs
from hybrid.runtime.options import RuntimeOptions
from hybrid.sampler import Sampler, SamplerConfig
from hybrid.tokenizer import Tokenizer

path = Path(sys.argv[1])
cfg = ModelConfig.from_folder(path)
tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
orig = DecodeGraphs.pin_embed
skip = {"on": False}
DecodeGraphs.pin_embed = lambda self: None if skip["on"] else orig(self)
ids = list(range(100, 132))
for mode in ("load", "first_step", "load", "first_step"):
    skip["on"] = mode == "first_step"
    t = time.perf_counter()
    opts = RuntimeOptions(device="cuda", gpus=(0,), cache_slots=(cfg.num_hidden_layers * cfg.num_experts,),
                          cpu_engine="torch")
    s = open_session(path, opts, context=len(ids) + 140)
    load = time.perf_counter() - t
    skip["on"] = False
    hm = s.model
    hm.prompt_tokens = len(ids)
    gens = [generate(hm, tok, ids, 64, Sampler(SamplerConfig())) for _ in range(2)]
    print(json.dumps({"mode": mode, "load_s": round(load, 2),
                      "load_parts": {k: round(v, 3) for k, v in s.load_s.items()},
                      "first_gen": {"decode_s": round(gens[0].decode_s, 4), "tok_s": round(gens[0].decode_tok_s, 1),
                                    "prefill_s": round(gens[0].prefill_s, 4)},
                      "second_gen": {"decode_s": round(gens[1].decode_s, 4), "tok_s": round(gens[1].decode_tok_s, 1)},
                      "same_ids": gens[0].generated_ids == gens[1].generated_ids,
                      "pinned": hm.graphs._host_embed is not None}), flush=True)
    s.close()
    del s, hm, gens
    gc.collect()
    torch.cuda.empty_cache()

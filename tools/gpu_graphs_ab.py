"""Device check (issue 7): cap-16 decode of the synthetic 30B-A3B checkpoint, graphs on, R repeats, in this
tree (run it from a copy of the tree with the old hybrid/runtime/graphs.py for the A/B).
argv: synth path, expert profile json, label. JSON lines on stdout."""
import json, sys
import torch
from hybrid.model.config import ModelConfig
from hybrid.runtime import RuntimeOptions, open_session
from hybrid.tokenizer import Tokenizer
from hybrid.bench.decode import measure

path, prof, label = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = ModelConfig.from_folder(path)
tok = Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
s = open_session(path, RuntimeOptions(device="cuda", gpus=(0, 0), vram_cap_gib=(16.0,), profile="h200",
                                      expert_profile=prof), context=32 + 64)
for r in range(3):
    rec = measure(s, tok, 32, 16 if r == 0 else 4, 64)
    print(json.dumps({"check": "graphs_ab", "label": label, "rep": r, "decode_tok_s": rec["decode_tok_s"],
                      **{k: rec.get(k) for k in ("route_sync_ms_per_token", "gpu_expert_ms_per_token")},
                      "graph_steps": s.stats.graph_steps}), flush=True)
s.close()

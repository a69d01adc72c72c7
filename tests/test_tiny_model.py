"""The embedded tiny model (hybrid/assets/tiny): shipped inside the package, within the size
limits, and loadable by transformers' Qwen3MoeForCausalLM with sane, code-like output."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import hybrid

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TINY = Path(hybrid.__file__).parent / "assets" / "tiny"
SHARD_LIMIT = 15_000_000
FOLDER_LIMIT = 56 * 2**20
# Not from the training corpus (written for this test).
HELD_OUT = ('def read_lines(path):\n    """Return the lines of a text file."""\n'
            '    with open(path) as f:\n        return [line.rstrip("\\n") for line in f]\n')


def _files() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in TINY.iterdir() if p.is_file()}


def test_folder_present_and_within_size_limits():
    files = _files()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json", "MODEL_CARD.md", "training_curve.png",
                 "corpus_manifest.json.gz"):
        assert name in files, name
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    assert shards and all(files[n] <= SHARD_LIMIT for n in shards), {n: files[n] for n in shards}
    assert sum(files.values()) <= FOLDER_LIMIT
    assert files["corpus_manifest.json.gz"] < 1_000_000
    index = json.loads((TINY / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards


def test_manifest_is_compact_and_records_the_held_out_files():
    import gzip
    m = json.loads(gzip.decompress((TINY / "corpus_manifest.json.gz").read_bytes()))
    assert m["columns"] == ["root", "rel", "sha256", "bytes", "split"]   # hybrid.bench.prompts reads these
    rows = m["files"]
    assert rows and {r[4] for r in rows} <= {"val", "test"}
    assert all(len(r[2]) == 64 and r[3] > 0 for r in rows)
    test = [r for r in rows if r[4] == "test"]
    assert len(test) == m["splits"]["test"]["files"] and any(r[0] == "stdlib" for r in test)
    assert sum(r[3] for r in test) == m["splits"]["test"]["bytes"]
    counts = [sum(v[i] for v in m["packages"].values()) for i in range(3)]
    assert counts == [m["splits"][s]["files"] for s in ("train", "val", "test")]
    assert len(m["corpus_sha256"]) == len(m["train_sha256"]) == 64
    assert m["splits"]["train"]["tokens"] <= m["caps"]["max_train_tokens"]


def test_card_numbers_match_the_record():
    card = (TINY / "MODEL_CARD.md").read_text()
    rec = [json.loads(line) for line in (Path(__file__).parents[1] / "results" / "tiny_model.jsonl").read_text().splitlines()]
    last = rec[-1]
    assert last["git_sha"] in card and f"{math.exp(last['test']['nll']):.2f}" in card
    assert "Replaces the first model" in card and len(rec) >= 2
    first_set = last["comparison"]["sets"]["first_model_test_split"]
    assert first_set["new"]["bpb"] < first_set["old"]["bpb"]          # committed only if better
    assert sum(r["top10pct_mass_share"] >= 0.2 for r in last["test"]["routing"]) > len(last["test"]["routing"]) / 2


def test_tensor_names_are_qwen3_moe_plus_mtp():
    cfg = json.loads((TINY / "config.json").read_text())
    names = set(json.loads((TINY / "model.safetensors.index.json").read_text())["weight_map"])
    last, e_last = cfg["num_hidden_layers"] - 1, cfg["num_experts"] - 1
    for n in ("model.embed_tokens.weight", "model.norm.weight",
              f"model.layers.{last}.self_attn.q_norm.weight", f"model.layers.{last}.mlp.gate.weight",
              f"model.layers.{last}.mlp.experts.{e_last}.down_proj.weight",
              "mtp.eh_proj.weight", "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight"):
        assert n in names, n
    assert "lm_head.weight" not in names      # tied embeddings
    assert cfg["num_nextn_predict_layers"] == 1


def test_config_loads_with_transformers():
    cfg = transformers.Qwen3MoeConfig.from_pretrained(TINY)
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_hidden_layers >= 4 and cfg.num_experts >= 32 and cfg.num_experts_per_tok >= 4
    assert cfg.hidden_size % 256 == 0 and cfg.moe_intermediate_size % 256 == 0
    assert (cfg.num_attention_heads * cfg.head_dim) % 256 == 0
    assert cfg.num_key_value_heads < cfg.num_attention_heads          # GQA
    assert cfg.norm_topk_prob and cfg.tie_word_embeddings and cfg.mlp_only_layers == []


@pytest.fixture(scope="module")
def hf():
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    tok = tokenizers.Tokenizer.from_file(str(TINY / "tokenizer.json"))
    return model.eval(), tok


def test_logits_finite_and_better_than_uniform(hf):
    model, tok = hf
    ids = torch.tensor([tok.encode(HELD_OUT).ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
    assert nll < 0.5 * math.log(model.config.vocab_size), nll


def test_greedy_fibonacci_is_code_like(hf):
    model, tok = hf
    eot = tok.token_to_id("<|endoftext|>")
    prompt = torch.tensor([[eot] + tok.encode("def fibonacci(n):").ids])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=eot)
    text = tok.decode(out[0, prompt.shape[1]:].tolist())
    assert any(s in text for s in ("return", "(", "if ", "=")), text

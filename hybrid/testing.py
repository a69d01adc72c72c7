"""Small random Hugging Face model folders for tests and synthetic benchmarks (no downloads).

`write_random_model(folder, ...)` writes config.json, generation_config.json, tokenizer.json and
BF16 safetensors (optionally sharded with an index) for qwen3_moe, qwen2_moe or mixtral.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybrid.checkpoint.names import Names

_TOKENIZER_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "The quick brown fox jumps over the lazy dog. Mixture of experts models route each token "
    "to a few experts. Hello world! import numpy as np\nclass Cache:\n    pass\n"
)


def random_config(model_type: str = "qwen3_moe", **kw) -> dict:
    """A small config.json dict; keyword arguments override fields."""
    cfg = {
        "model_type": model_type, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if model_type == "mixtral":
        cfg.update(architectures=["MixtralForCausalLM"], intermediate_size=32,
                   num_local_experts=8, num_experts_per_tok=2)
    else:
        cfg.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                   intermediate_size=128, attention_bias=False)
        cfg["architectures"] = ["Qwen3MoeForCausalLM" if model_type == "qwen3_moe" else "Qwen2MoeForCausalLM"]
        if model_type == "qwen2_moe":
            cfg.update(shared_expert_intermediate_size=48, norm_topk_prob=False, attention_bias=True)
    cfg.update(kw)
    return cfg


def random_state_dict(cfg: dict, seed: int = 0, skew: float = 0.0) -> dict[str, torch.Tensor]:
    """BF16 weights with the architecture's names. skew > 0 biases routers toward low expert ids."""
    g = torch.Generator().manual_seed(seed)
    mt, h, v = cfg["model_type"], cfg["hidden_size"], cfg["vocab_size"]
    n_layers, hd = cfg["num_hidden_layers"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    names = Names(mt)

    def rnd(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    sd = {f"{names.embed()}.weight": rnd(v, h, std=1.0), f"{names.final_norm()}.weight": norm(h)}
    if not cfg.get("tie_word_embeddings"):
        sd[f"{names.lm_head()}.weight"] = rnd(v, h)
    for L in range(n_layers):
        for p, n_out in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            sd[f"{names.attn(L, p)}.weight"] = rnd(n_out, h)
            if cfg.get("attention_bias"):
                sd[f"{names.attn(L, p)}.bias"] = rnd(n_out, std=0.02)
        sd[f"{names.attn(L, 'o_proj')}.weight"] = rnd(h, nq * hd)
        sd[f"{names.layer('input_norm', L)}.weight"] = norm(h)
        sd[f"{names.layer('post_norm', L)}.weight"] = norm(h)
        if names.has_qk_norm:
            sd[f"{names.layer('q_norm', L)}.weight"] = norm(hd)
            sd[f"{names.layer('k_norm', L)}.weight"] = norm(hd)
        router = rnd(n_exp, h).float()
        if skew:
            router += skew * torch.linspace(1.0, 0.0, n_exp).unsqueeze(1) * router.abs().mean()
        sd[f"{names.layer('router', L)}.weight"] = router.to(torch.bfloat16)
        for e in range(n_exp):
            sd[f"{names.expert(L, e, 'gate')}.weight"] = rnd(inter, h)
            sd[f"{names.expert(L, e, 'up')}.weight"] = rnd(inter, h)
            sd[f"{names.expert(L, e, 'down')}.weight"] = rnd(h, inter)
        if names.has_shared_expert:
            si = cfg["shared_expert_intermediate_size"]
            sd[f"{names.shared_expert(L, 'gate')}.weight"] = rnd(si, h)
            sd[f"{names.shared_expert(L, 'up')}.weight"] = rnd(si, h)
            sd[f"{names.shared_expert(L, 'down')}.weight"] = rnd(h, si)
            sd[f"{names.layer('shared_expert_gate', L)}.weight"] = rnd(1, h)
    return sd


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json trained on a fixed string; padded to vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}))


def write_random_model(folder: str | Path, model_type: str = "qwen3_moe", seed: int = 0,
                       shards: int = 1, skew: float = 0.0, **cfg_overrides) -> Path:
    """Write a random BF16 model folder; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = random_config(model_type, **cfg_overrides)
    sd = random_state_dict(cfg, seed=seed, skew=skew)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}))
    write_tokenizer(folder, cfg["vocab_size"])
    save_shards(folder, sd, shards)
    return folder


def save_shards(folder: Path, sd: dict[str, torch.Tensor], shards: int = 1) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    if shards <= 1:
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(sd)
    weight_map, total = {}, 0
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(folder / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def tokenizer_for(path: str | Path):
    """The tokenizer of a model folder (its config's vocabulary size and BOS/EOS ids)."""
    from hybrid.model.config import ModelConfig
    from hybrid.tokenizer import Tokenizer

    cfg = ModelConfig.from_folder(path)
    return Tokenizer(path, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)


def greedy_logits(model, ids: list[int], n: int, chunk: int = 0) -> tuple[list[int], torch.Tensor]:
    """Prefill ids (in chunks of `chunk` tokens; 0: at once), then n greedy decode steps -> (the n ids, [n, V]
    logits of the decode steps)."""
    from hybrid.generate import prefill

    model.new_cache(len(ids) + n + 1)
    logits = prefill(model, ids, chunk)
    out, rows = [], []
    for step in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor([out[-1]]), len(ids) + step, last_only=True)
        rows.append(logits[-1])
    return out, torch.stack(rows)


def write_expert_profile(model_dir: str | Path, counts, tokens: int, path: str | Path) -> str:
    """An expert-popularity file (what hybrid-profile writes) for the model at model_dir with routing
    counts [layers, experts] over `tokens` tokens -> its path as a string (RuntimeOptions.expert_profile)."""
    from hybrid.experts.popularity import profile_file_dict
    from hybrid.model.config import ModelConfig

    cfg = ModelConfig.from_folder(model_dir)
    Path(path).write_text(json.dumps(profile_file_dict(Path(model_dir).name, cfg.model_type, counts, tokens,
                                                  cfg.num_experts_per_tok, {"test": True})))
    return str(path)

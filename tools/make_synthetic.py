"""Write a Qwen3-30B-A3B-shaped NVFP4 checkpoint (ModelOpt layout) with random weights, fast.

Packed weights are random bytes, block scales e4m3 near 1, weight_scale_2 chosen so each Linear
has a plausible std (1/sqrt(K) for inputs to attention / experts, 0.1/sqrt(K) for o_proj and
down_proj so the residual stream keeps its shared direction). Routing skew: every embedding row
carries a shared direction d; router row e of layer l gets -skew * ln(1 + rank_l(e)) * d / H
(rank_l a random permutation per layer), so P(expert) ~ (1 + rank)^-skew up to per-token noise.
Generated on the GPU when there is one (random bytes there, then to the host); never committed.

    python3 tools/make_synthetic.py OUT [--skew 1.0] [--layers 48] [--experts 128] [--hidden 2048]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybrid.checkpoint.names import Names
from hybrid.testing import write_tokenizer

E2M1_STD = math.sqrt(68.5 / 8)      # std of a uniformly random E2M1 code
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, intermediate_size=6144)


def config(**kw) -> dict:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **QWEN3_30B_A3B,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "attention_bias": False, "torch_dtype": "bfloat16"}
    cfg.update({k: v for k, v in kw.items() if v is not None})
    return cfg


class Gen:
    """Random tensors made on `device`, returned on the CPU."""

    def __init__(self, device: str, seed: int):
        self.device = torch.device(device)
        self.g = torch.Generator(self.device).manual_seed(seed)

    def nvfp4(self, n: int, k: int, std: float, s2: float | None = None) -> dict:
        data = torch.randint(0, 256, (n, k // 2), generator=self.g, dtype=torch.uint8, device=self.device)
        sc = 1.0 + 0.25 * torch.rand(n, k // 16, generator=self.g, device=self.device)
        scale_2 = std / (E2M1_STD * 1.125) if s2 is None else s2
        return {"weight": data.cpu(), "weight_scale": sc.to(torch.float8_e4m3fn).cpu(),
                "weight_scale_2": torch.tensor(scale_2, dtype=torch.float32),
                "input_scale": torch.tensor(1.0, dtype=torch.float32)}

    def randn(self, *shape, std=1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, device=self.device) * std


def linear(sd: dict, name: str, parts: dict) -> None:
    for k, v in parts.items():
        sd[f"{name}.{k}"] = v


def layer_tensors(gen: Gen, cfg: dict, nm: Names, L: int, d: torch.Tensor, skew: float) -> dict:
    h, hd, nq, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    sd: dict[str, torch.Tensor] = {}
    s2 = 1.0 / math.sqrt(h) / (E2M1_STD * 1.125)                      # q/k/v share weight_scale_2
    for p, n in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
        linear(sd, nm.attn(L, p), gen.nvfp4(n, h, 0, s2))
    linear(sd, nm.attn(L, "o_proj"), gen.nvfp4(h, nq * hd, 0.1 / math.sqrt(nq * hd)))
    for key, n in (("input_norm", h), ("post_norm", h), ("q_norm", hd), ("k_norm", hd)):
        sd[f"{nm.layer(key, L)}.weight"] = torch.ones(n, dtype=torch.bfloat16)
    rank = torch.randperm(E, generator=gen.g, device=gen.device).float()
    bias = -skew * torch.log1p(rank) * 1.118                          # rms of embed rows ~ 1.118
    router = gen.randn(E, h, std=1.0 / math.sqrt(h)) + bias[:, None] * d[None, :] / h
    sd[f"{nm.layer('router', L)}.weight"] = router.to(torch.bfloat16).cpu()
    for e in range(E):
        gu = 1.0 / math.sqrt(h) / (E2M1_STD * 1.125)                  # gate/up share weight_scale_2
        linear(sd, nm.expert(L, e, "gate"), gen.nvfp4(inter, h, 0, gu))
        linear(sd, nm.expert(L, e, "up"), gen.nvfp4(inter, h, 0, gu))
        linear(sd, nm.expert(L, e, "down"), gen.nvfp4(h, inter, 0.1 / math.sqrt(inter)))
    return sd


def write(out: Path, cfg: dict, skew: float, seed: int = 0, device: str | None = None, log=print) -> Path:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    gen, nm = Gen(device, seed), Names("qwen3_moe")
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    d = torch.where(gen.randn(h) > 0, 1.0, -1.0)                      # the shared direction [H]
    shards, weight_map, total, t0 = n_layers + 1, {}, 0, time.perf_counter()

    def save(i: int, sd: dict) -> None:
        nonlocal total
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(sd, str(out / fname), metadata={"format": "pt"})
        for k, t in sd.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()

    save(0, {f"{nm.embed()}.weight": (gen.randn(v, h, std=0.5) + d).to(torch.bfloat16).cpu(),
             f"{nm.lm_head()}.weight": gen.randn(v, h, std=1.0 / math.sqrt(h)).to(torch.bfloat16).cpu(),
             f"{nm.final_norm()}.weight": torch.ones(h, dtype=torch.bfloat16)})
    for L in range(n_layers):
        save(L + 1, layer_tensors(gen, cfg, nm, L, d, skew))
        if L % 8 == 7:
            log(f"  layer {L + 1}/{n_layers}: {total / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "synthetic"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head", "*mlp.gate"]}}))
    (out / "SYNTHETIC.md").write_text(f"Random weights (tools/make_synthetic.py, skew {skew}, seed {seed}); "
                                      f"not a real model. Never commit.\n")
    write_tokenizer(out, v)
    log(f"wrote {out}: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--skew", type=float, default=1.0, help="routing skew (0 = uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where random bytes are made (default: cuda if present)")
    for flag in ("layers", "experts", "hidden", "inter", "vocab", "top-k"):
        p.add_argument(f"--{flag}", type=int, default=None, help="override the 30B-A3B shape (tests)")
    a = p.parse_args(argv)
    cfg = config(num_hidden_layers=a.layers, num_experts=a.experts, hidden_size=a.hidden,
                 moe_intermediate_size=a.inter, vocab_size=a.vocab, num_experts_per_tok=a.top_k)
    write(a.out, cfg, a.skew, a.seed, a.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

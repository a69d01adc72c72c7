"""Build a MoEModel from a checkpoint folder: dense parts placed per layer, experts behind an executor."""
from __future__ import annotations

from pathlib import Path

import torch

from hybrid.checkpoint.names import Names
from hybrid.checkpoint.qweight import QWeight
from hybrid.checkpoint.formats import DENSE_DTYPES
from hybrid.checkpoint.reader import Checkpoint
from hybrid.model.head import quantize_head
from hybrid.model.layers import Attention
from hybrid.model.linear import Linear
from hybrid.model.moe import ReferenceExperts, SwiGLU
from hybrid.model.qwen_moe import DecoderLayer, MoEModel


class WeightSource:
    """Typed access to one checkpoint's weights by role (shapes checked against the config)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.cfg, self.names = ckpt, ckpt.config, Names(ckpt.config.model_type)

    def linear(self, module: str, n: int, k: int, bias: bool = False) -> Linear:
        b = self.ckpt.dense(f"{module}.bias", (n,)) if bias else None
        return Linear(self.ckpt.linear(module, (n, k)), b)

    def expert_weights(self, layer: int, e: int) -> tuple[QWeight, QWeight, QWeight]:
        """Stored (gate [I, H], up [I, H], down [H, I]) of one routed expert."""
        h, i, nm = self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.names
        return (self.ckpt.linear(nm.expert(layer, e, "gate"), (i, h)),
                self.ckpt.linear(nm.expert(layer, e, "up"), (i, h)),
                self.ckpt.linear(nm.expert(layer, e, "down"), (h, i)))

    def expert(self, layer: int, e: int) -> SwiGLU:
        return SwiGLU(*(Linear(w) for w in self.expert_weights(layer, e)))

    def layer(self, i: int, device: torch.device) -> DecoderLayer:
        cfg, nm, h = self.cfg, self.names, self.cfg.hidden_size
        qd, kvd, bias = cfg.q_dim, cfg.kv_dim, cfg.attention_bias
        lin = lambda p, n, k, b=False: self.linear(nm.attn(i, p), n, k, b).to(device)  # noqa: E731
        dense = lambda key, shape: self.ckpt.dense(f"{nm.layer(key, i)}.weight", shape).to(device)  # noqa: E731
        qn = dense("q_norm", (cfg.head_dim,)) if nm.has_qk_norm else None
        kn = dense("k_norm", (cfg.head_dim,)) if nm.has_qk_norm else None
        attn = Attention(lin("q_proj", qd, h, bias), lin("k_proj", kvd, h, bias), lin("v_proj", kvd, h, bias),
                         lin("o_proj", h, qd), cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim, qn, kn, cfg.rms_norm_eps)
        layer = DecoderLayer(attn, dense("input_norm", (h,)), dense("post_norm", (h,)),
                             self.ckpt.dense(f"{nm.layer('router', i)}.weight", (cfg.num_experts, h)).to(device))
        if nm.has_shared_expert and cfg.shared_expert_intermediate_size:
            si = cfg.shared_expert_intermediate_size
            layer.shared = SwiGLU(*(self.linear(nm.shared_expert(i, p), n, k) for p, n, k in
                                    (("gate", si, h), ("up", si, h), ("down", h, si)))).to(device)
            layer.shared_gate = self.ckpt.dense(f"{nm.layer('shared_expert_gate', i)}.weight", (1, h)).to(device)
        return layer


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               layer_devices: list[torch.device] | None = None, experts=None, lm_head: str = "keep") -> MoEModel:
    """Load a model for generation. dtype: fp32 on CPU, fp16 on CUDA by default.

    experts: an ExpertExecutor; default runs every expert through the reference linear path
    on the device of its layer. lm_head: "keep" (as stored), "fp8" or "nvfp4": a 16/32-bit head
    quantized once here (hybrid.model.head; a tied head's copy, the embedding stays as it is).
    """
    ckpt = Checkpoint(folder)
    ws = WeightSource(ckpt)
    cfg, nm = ckpt.config, ws.names
    device = torch.device(device)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    layer_devices = layer_devices or [device] * cfg.num_hidden_layers
    if len(layer_devices) != cfg.num_hidden_layers:
        raise ValueError(f"layer_devices has {len(layer_devices)} entries for {cfg.num_hidden_layers} layers")
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = ckpt.dense(f"{nm.embed()}.weight", (v, h))
    layers = [ws.layer(i, layer_devices[i]) for i in range(cfg.num_hidden_layers)]
    last = layer_devices[-1]
    if cfg.tie_word_embeddings and not ckpt.has(f"{nm.lm_head()}.weight"):
        head = Linear(QWeight(DENSE_DTYPES[embed.dtype], (v, h), embed, name=nm.lm_head()))
    else:
        head = ws.linear(nm.lm_head(), v, h)
    head = Linear(quantize_head(head.weight, lm_head, device=last), head.bias).to(last)
    final_norm = ckpt.dense(f"{nm.final_norm()}.weight", (h,)).to(last)
    experts = experts or ReferenceExperts(ws.expert)
    model = MoEModel(cfg, embed, layers, final_norm, head, experts, layer_devices, dtype)
    model.weights = ws
    return model

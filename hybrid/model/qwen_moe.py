"""Reference forward of the Qwen-MoE family (qwen3_moe; qwen2_moe's shared expert; mixtral).

Legend: T tokens, H hidden, V vocab, L layers. Each layer lives on a device from
`layer_devices`; the hidden state hops where consecutive layers differ (the layer split).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.model.config import ModelConfig
from hybrid.model.layers import Attention, KVCache, Rotary, rms_norm
from hybrid.model.linear import Linear
from hybrid.model.moe import ExpertExecutor, SwiGLU, route


@dataclass
class DecoderLayer:
    attn: Attention
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor                      # [E, H], never quantized
    shared: SwiGLU | None = None              # qwen2_moe
    shared_gate: torch.Tensor | None = None   # [1, H]


class MoEModel:
    """Embedding -> L decoder layers (attention + MoE) -> norm -> lm_head."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer],
                 final_norm: torch.Tensor, lm_head: Linear, experts: ExpertExecutor,
                 layer_devices: list[torch.device], dtype: torch.dtype):
        self.cfg, self.embed, self.layers = cfg, embed, layers
        self.final_norm, self.lm_head, self.experts = final_norm, lm_head, experts
        self.layer_devices, self.dtype = layer_devices, dtype
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.cache: KVCache | None = None
        self.on_route = None  # optional callback(layer, ids, weights) for traces and stats

    def new_cache(self, max_tokens: int) -> KVCache:
        self.cache = KVCache(self.cfg.num_hidden_layers, max_tokens, self.cfg.num_key_value_heads,
                             self.cfg.head_dim, self.dtype, self.layer_devices)
        return self.cache

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 (cache holds [0, start)) -> logits [T or 1, V] fp32."""
        cfg, cache = self.cfg, self.cache
        if cache is None or start + ids.shape[0] > cache.max_tokens:
            raise ValueError("KV cache missing or too small: call new_cache(max_tokens) first")
        dev0 = self.layer_devices[0]
        x = self.embed[ids.to(self.embed.device)].to(dev0, self.dtype)       # [T, H]
        positions = torch.arange(start, start + ids.shape[0])
        cos_sin: dict[torch.device, tuple] = {}
        for i, layer in enumerate(self.layers):
            dev = self.layer_devices[i]
            if x.device != dev:
                x = x.to(dev)                                                # layer-split hop
            if dev not in cos_sin:
                cos_sin[dev] = self.rotary.cos_sin(positions, dev)
            cos, sin = cos_sin[dev]
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + layer.attn(h, i, start, cache, cos, sin)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + self._moe(i, layer, h)
        cache.length = start + ids.shape[0]
        if last_only:
            x = x[-1:]
        x = rms_norm(x.to(self.lm_head.device), self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(x).float()                                       # [T, V]

    def _moe(self, i: int, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        ids, weights = route(h, layer.router, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        if self.on_route is not None:
            self.on_route(i, ids, weights)
        out = self.experts(i, h, ids, weights)                               # [T, H]
        if layer.shared is not None:
            gate = torch.sigmoid(h.float() @ layer.shared_gate.float().T)    # [T, 1]
            out = out + (gate * layer.shared(h).float()).to(out.dtype)
        return out

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for a whole sequence with a fresh cache: ids [T] -> [T, V] fp32."""
        self.new_cache(ids.shape[0])
        return self.forward(ids, 0)

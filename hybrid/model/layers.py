"""Building blocks of the Qwen-MoE family: RMSNorm, rotary embedding, GQA attention with a KV cache.

Legend: T tokens in this call, P past tokens in the cache, H hidden, Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

import torch

from hybrid.model.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] -> [..., H], computed in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class Rotary:
    """Rotate-half RoPE over the full head dim, inv_freq = theta^(-2i/D)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().to(device)[:, None] * self.inv_freq.to(device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                            # [T, D]
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]."""
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        xf = x.float() * cos[:, None, :] + rot.float() * sin[:, None, :]
        return xf.to(x.dtype)


class KVCache:
    """Preallocated per-layer K/V: [max_tokens, Hkv, D] each, fp16/fp32 (int8 arrives with the runtime)."""

    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, devices: list[torch.device]):
        self.max_tokens = max_tokens
        self.k = [torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=d) for d in devices]
        self.v = [torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=d) for d in devices]
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.max_tokens}")
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def reset(self) -> None:
        self.length = 0


class Attention:
    """GQA self-attention with optional q/k RMSNorm (Qwen3) and biases (Qwen2)."""

    def __init__(self, q: Linear, k: Linear, v: Linear, o: Linear, n_heads: int, n_kv: int,
                 head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float):
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, eps

    def __call__(self, x: torch.Tensor, layer: int, start: int, cache: KVCache,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q(x).view(t, self.n_heads, self.head_dim)   # [T, Hq, D]
        k = self.k(x).view(t, self.n_kv, self.head_dim)      # [T, Hkv, D]
        v = self.v(x).view(t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        cache.write(layer, start, k, v)
        keys = cache.k[layer][: start + t]                    # [P+T, Hkv, D]
        vals = cache.v[layer][: start + t]
        out = self._attend(q, keys, vals, start)              # [T, Hq*D]
        return self.o(out)

    def _attend(self, q, keys, vals, start):
        t, group = q.shape[0], self.n_heads // self.n_kv
        qh = q.transpose(0, 1).float()                                       # [Hq, T, D]
        kh = keys.transpose(0, 1).float().repeat_interleave(group, dim=0)    # [Hq, P+T, D]
        vh = vals.transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = qh @ kh.transpose(1, 2) / self.head_dim ** 0.5              # [Hq, T, P+T]
        pos_q = torch.arange(start, start + t, device=q.device)[:, None]
        pos_k = torch.arange(kh.shape[1], device=q.device)[None, :]
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vh                             # [Hq, T, D]
        return out.transpose(0, 1).reshape(t, -1).to(q.dtype)

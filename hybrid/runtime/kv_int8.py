"""Int8 KV cache (--kv-dtype int8): per token and KV head, int8 values and one fp16 scale (absmax/127).

Drop-in for hybrid.model.layers.KVCache: `write(layer, start, k, v)` quantizes; `k[layer][a:b]` and
`v[layer][a:b]` return dequantized [b-a, Hkv, D] tensors in the model dtype, so Attention is unchanged.
Bytes per token-layer: Hkv x (D + 2) x 2, as the planner counts them.
"""
from __future__ import annotations

import torch

from hybrid.model.layers import KVCache


class _Int8Tensor:
    """q int8 [N, Hkv, D] + scale fp16 [N, Hkv, 1]; slicing dequantizes to `dtype`."""

    def __init__(self, n: int, heads: int, dim: int, dtype: torch.dtype, device):
        self.q = torch.zeros(n, heads, dim, dtype=torch.int8, device=device)
        self.scale = torch.zeros(n, heads, 1, dtype=torch.float16, device=device)
        self.dtype = dtype

    def __getitem__(self, idx) -> torch.Tensor:
        return (self.q[idx].float() * self.scale[idx].float()).to(self.dtype)

    def __setitem__(self, idx, x: torch.Tensor) -> None:
        xf = x.float()                                                        # [t, Hkv, D]
        s = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-8)        # [t, Hkv, 1]
        s16 = s.to(torch.float16).float().clamp_min(6e-8)                     # what is stored
        self.q[idx] = torch.round(xf / s16).clamp_(-127, 127).to(torch.int8)
        self.scale[idx] = s16.to(torch.float16)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2


class Int8KVCache:
    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, devices: list):
        self.max_tokens = max_tokens
        self.k = [_Int8Tensor(max_tokens, kv_heads, head_dim, dtype, d) for d in devices]
        self.v = [_Int8Tensor(max_tokens, kv_heads, head_dim, dtype, d) for d in devices]
        self.length = 0

    # KVCache's own write (bounds check, then k[layer][a:b] = ...: here _Int8Tensor quantizes) and
    # reset. Shared, not inherited: Attention sends a KVCache instance down the CUDA path, which
    # reads k_store/v_store directly.
    write = KVCache.write
    reset = KVCache.reset

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

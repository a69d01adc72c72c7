"""Re-pack ModelOpt NVFP4 weights into ggml's NVFP4 blocks (GGML type 40), bit for bit.

ModelOpt, per row of K elements: packed u8 [K/2] (byte j = element 2j low nibble | 2j+1 high),
e4m3 scales [K/16], one fp32 weight_scale_2 per tensor.
ggml block_nvfp4 (36 bytes per 64 elements): d[4] UE4M3 sub-block scales, then qs[32]; sub-block s
(16 elements) lives in qs[8s : 8s+8], byte j holding element j (low nibble) and j+8 (high nibble).
ggml decodes d with the sign bit stripped and the same E2M1 codes, so values are identical; the
per-tensor scale_2 goes to a separate `<name>.scale` F32 tensor that llama.cpp multiplies in after
the matmul ([1] for a plain linear, [E] for stacked experts).
"""
from __future__ import annotations

import numpy as np
import torch

from hybrid.errors import CheckpointError

QK = 64          # elements per ggml NVFP4 block
SUB = 16         # elements per sub-block (= ModelOpt group)
BLOCK_BYTES = 36


def repack_rows(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> np.ndarray:
    """ModelOpt NVFP4 [N, K/2] u8 + [N, K/16] e4m3 -> ggml blocks u8 [N, K/64*36]."""
    n, half_k = packed.shape
    k = half_k * 2
    if k % QK:
        raise CheckpointError(f"{name}: in-features {k} not a multiple of {QK}; ggml NVFP4 cannot hold it")
    if tuple(scale.shape) != (n, k // SUB):
        raise CheckpointError(f"{name}: weight_scale shape {tuple(scale.shape)} != {(n, k // SUB)}")
    p = packed.numpy().reshape(n, k // SUB, SUB // 2)                      # [N, G, 8]
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(n, k // SUB, SUB)  # [N, G, 16] in order
    qs = (codes[:, :, :8] | (codes[:, :, 8:] << 4)).astype(np.uint8)       # [N, G, 8]
    d = scale.view(torch.uint8).numpy().reshape(n, k // SUB) & 0x7F        # [N, G] UE4M3
    nb = k // QK
    blocks = np.concatenate([d.reshape(n, nb, 4), qs.reshape(n, nb, 32)], axis=-1)  # [N, nb, 36]
    return np.ascontiguousarray(blocks.reshape(n, nb * BLOCK_BYTES))


def dequant_blocks(blocks: np.ndarray, k: int) -> np.ndarray:
    """Reference decode of ggml NVFP4 blocks u8 [N, K/64*36] -> float32 [N, K] (for tests)."""
    from hybrid.checkpoint.formats import E2M1_TABLE, e4m3_table

    n = blocks.shape[0]
    b = blocks.reshape(n, k // QK, BLOCK_BYTES)
    d = e4m3_table()[b[:, :, :4]]                                  # [N, nb, 4]
    qs = b[:, :, 4:].reshape(n, k // QK, 4, 8)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # [N, nb, 4, 16]
    vals = E2M1_TABLE[codes] * d[..., None]
    return vals.reshape(n, k).astype(np.float32)

"""VRAM formulas: KV cache and workspace per card.

KV (per card) = resident tokens × its layers × kv bytes per token-layer, where
    fp16: kv_heads × head_dim × 2 (K and V) × 2 bytes
    int8: kv_heads × (head_dim + 2) × 2          (int8 values + one fp16 scale per token and head)

Workspace (per card) = context + activations + attention + MoE + logits + graph reserve, with
C = prefill chunk tokens:
    context     = the GPU profile's context_mib, on the first logical card of each physical GPU
    activations = C × (4·H + q_dim + 2·kv_dim) × 4       fp32 residual, normed, attn-out, moe-out, qkv
    attention   = C × n_heads × ATTN_TILE × 2            fp16 scores, keys tiled ATTN_TILE at a time
    moe         = C × top_k × (2·I + H) × 2 + C × E × 4  expert intermediates fp16, router logits fp32
    logits      = SPEC_ROWS × vocab × 4                  fp32, last card only (verify rows)
    graph       = GRAPH_RESERVE_MIB                      CUDA graph pools + allocator slack

Prefill staging (per card, when prefill offload is on; hybrid.runtime.prefill_stream), with
G = PREFILL_STAGE_GROUP experts per group and S = one expert slot's bytes:
    staging     = 6 · G · S        two buffers of G slots (2GS), the device copy of one group as
                                   stored (~GS), the group's CPU-store slots as uploaded (~GS, when
                                   streamed from the pinned store), the NVFP4 pack's transients (two
                                   int32 copies of a quarter of the group's gate/up bytes: ~1.2GS;
                                   2GS kept)
"""
from __future__ import annotations

from hybrid.model.config import ModelConfig

MIB, GIB = 2**20, 2**30
ATTN_TILE = 2048
SPEC_ROWS = 8
GRAPH_RESERVE_MIB = 256
KV_DTYPES = ("fp16", "int8")
PREFILL_STAGE_GROUP = 16    # experts per prefill staging group (two groups' slots per card)


def kv_bytes_per_token_layer(cfg: ModelConfig, kv_dtype: str) -> int:
    if kv_dtype == "fp16":
        return cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    if kv_dtype == "int8":
        return cfg.num_key_value_heads * (cfg.head_dim + 2) * 2
    raise ValueError(f"kv dtype {kv_dtype!r} not in {KV_DTYPES}")


def kv_bytes(cfg: ModelConfig, tokens: int, layers: int, kv_dtype: str) -> int:
    return tokens * layers * kv_bytes_per_token_layer(cfg, kv_dtype)


def workspace_bytes(cfg: ModelConfig, chunk: int, context_bytes: int, holds_head: bool) -> int:
    """Bytes of scratch a card needs besides weights, KV and cache slots (formula above)."""
    h, c = cfg.hidden_size, chunk
    act = c * (4 * h + cfg.q_dim + 2 * cfg.kv_dim) * 4
    attn = c * cfg.num_attention_heads * ATTN_TILE * 2
    moe = c * cfg.num_experts_per_tok * (2 * cfg.moe_intermediate_size + h) * 2 + c * cfg.num_experts * 4
    logits = SPEC_ROWS * cfg.vocab_size * 4 if holds_head else 0
    return context_bytes + act + attn + moe + logits + GRAPH_RESERVE_MIB * MIB


def prefill_stage_bytes(slot_bytes: int, group: int = PREFILL_STAGE_GROUP) -> int:
    """Bytes a card reserves for prefill staging (formula above; group 0 = offload off)."""
    return 6 * group * slot_bytes


def gib(n: float) -> str:
    """A readable size: '15.8 GiB', or '732 MiB' below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"

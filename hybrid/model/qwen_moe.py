"""Reference forward of the Qwen-MoE family (qwen3_moe; qwen2_moe's shared expert; mixtral).

Legend: T tokens, H hidden, V vocab, L layers, k experts per token. Each layer lives on a device
from `layer_devices`; the hidden state hops where consecutive layers differ (the layer split).

`forward` is the eager step. The pieces `embed_tokens`, `decode_dense`, `moe_out`, `head` are
the same math for one token with its position as a device tensor, for CUDA graphs
(hybrid.runtime.graphs). On CUDA the fused kernels (hybrid.kernels.fused; HYBRID_FUSED=0 turns them
off) do residual add + RMSNorm and the router's softmax / top-k / renormalisation in one launch each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.kernels import driver, fused
from hybrid.kernels.moe_route import RoutePlan
from hybrid.model.config import ModelConfig
from hybrid.model.layers import Attention, KVCache, Rotary, add_rms_norm, decode_mask, fused_norm_ok, rms_norm
from hybrid.model.linear import Linear
from hybrid.model.moe import ExpertExecutor, SwiGLU, route


@dataclass
class RouteOut:
    """Buffers a one-token step's routing is also written into, by the router's own launch on CUDA
    (hybrid.runtime graphs): slots [T*k] int32 = slot_table[ids] (slot_table [E] int32, expert ->
    slot), row [T, 2k] fp32 = (ids as floats, weights). Any of them may be None (slot_table and
    slots together). plan (hybrid.kernels.moe_route.RoutePlan, with slots): the grouped MoE kernels'
    routing of those slot ids, made by the same launch where its kernel can (plan.made)."""

    slot_table: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    row: torch.Tensor | None = None
    plan: RoutePlan | None = None


def _route_extra(out: RouteOut | None) -> tuple:
    return (out.slot_table, out.slots, out.row) if out is not None else (None, None, None)


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
        self._prepared = False
        self.kv_reserve = 0   # CUDA: rows the first KV store gets at least (the runtime's context)

    def new_cache(self, max_tokens: int) -> KVCache:
        """A fresh cache. On CUDA it reuses the K/V stores of the last one when they are large
        enough (stale rows past the new tokens are never read), so captured graphs stay valid."""
        cfg, old = self.cfg, self.cache
        cuda = self.layer_devices[0].type == "cuda"
        stores = None
        if (isinstance(old, KVCache) and cuda and old.capacity >= max_tokens
                and old.k_store[0].dtype == self.dtype):
            stores = (old.k_store, old.v_store)
        elif cuda:                                  # rows a multiple of 64 (aligned attention masks)
            rows = -(-max(max_tokens, self.kv_reserve) // 64) * 64
            stores = KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim,
                             self.dtype, self.layer_devices)
            stores = (stores.k_store, stores.v_store)
        self.cache = KVCache(cfg.num_hidden_layers, max_tokens, cfg.num_key_value_heads,
                             cfg.head_dim, self.dtype, self.layer_devices, stores)
        return self.cache

    def prepare(self) -> None:
        """CUDA: router and norm weights in fp32 once (exact), instead of converting at every call."""
        if self._prepared:
            return
        for i, layer in enumerate(self.layers):
            if self.layer_devices[i].type == "cuda":
                layer.router = layer.router.float()
                layer.input_norm, layer.post_norm = layer.input_norm.float(), layer.post_norm.float()
                if layer.attn.q_norm is not None:
                    layer.attn.q_norm, layer.attn.k_norm = layer.attn.q_norm.float(), layer.attn.k_norm.float()
        if self.final_norm.is_cuda:
            self.final_norm = self.final_norm.float()
        self._prepared = True

    def rope_table(self, device: torch.device) -> torch.Tensor:
        """[n, 2, D] cos / signed sin for every position the cache holds."""
        n = self.cache.capacity if isinstance(self.cache, KVCache) else self.cache.max_tokens
        return self.rotary.table(device, max(n, self.cfg.max_position_embeddings or 0, 1))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 (cache holds [0, start)) -> logits [T or 1, V] fp32."""
        cfg, cache = self.cfg, self.cache
        if cache is None or start + ids.shape[0] > cache.max_tokens:
            raise ValueError("KV cache missing or too small: call new_cache(max_tokens) first")
        self.prepare()
        x = self.embed_tokens(ids)                                           # [T, H]
        positions = None
        cos_sin: dict[torch.device, tuple] = {}
        for i, layer in enumerate(self.layers):
            dev = self.layer_devices[i]
            if x.device != dev:
                x = x.to(dev)                                                # layer-split hop
            with driver.current(dev):                   # a second card's launches: no switch each
                if dev not in cos_sin:
                    if dev.type == "cuda" and isinstance(cache, KVCache):
                        cos_sin[dev] = (self.rope_table(dev), None)     # Attention's CUDA path
                    else:
                        positions = torch.arange(start, start + ids.shape[0]) if positions is None else positions
                        cos_sin[dev] = self.rotary.cos_sin(positions, dev)
                cos, sin = cos_sin[dev]
                h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
                x, h, routed = self._post_attn(i, x, layer.attn(h, i, start, cache, cos, sin))
                x = x + self._moe(i, layer, h, routed)
        cache.length = start + ids.shape[0]
        if last_only:
            x = x[-1:]
        with driver.current(self.lm_head.device):
            return self.head(x)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, H] in the model dtype on the first layer's device."""
        return self.embed[ids.to(self.embed.device)].to(self.layer_devices[0], self.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: [T, H] -> logits [T, V] fp32."""
        x = rms_norm(x.to(self.lm_head.device), self.final_norm, self.cfg.rms_norm_eps)
        return self.lm_head(x).float()                                       # [T, V]

    def route(self, i: int, h: torch.Tensor, out: RouteOut | None = None):
        """h [T, H] -> (ids [T, k] int64, weights [T, k] fp32); out: buffers also written (RouteOut).
        CUDA: router GEMV + softmax / top-k / renormalisation (+ out) as one fused kernel for T <= 8;
        for longer T the GEMV through cuBLAS, then the fused softmax / top-k."""
        router, k = self.layers[i].router, self.cfg.num_experts_per_tok
        extra = _route_extra(out)
        if self._fused_route_ok(i, h):
            if (h.shape[0] <= fused.ROUTER_MAX_T and h.shape[1] % 4 == 0 and h.is_contiguous()
                    and h.dtype in (torch.float16, torch.float32)):
                return fused.router_topk(h, router, k, self.cfg.norm_topk_prob, *extra)
            logits = h.float() @ router.T                                          # [T, E] fp32
            return fused.route_topk(logits.contiguous(), k, self.cfg.norm_topk_prob, *extra)
        ids, weights = route(h, router, k, self.cfg.norm_topk_prob)
        if out is not None:
            fused.ref_route_outputs(ids, weights, *extra)
        return ids, weights

    def _post_attn(self, i: int, x: torch.Tensor, a: torch.Tensor, route_out: RouteOut | None = None):
        """x + attention output a -> (x, post-attention normed h, (ids, weights) or None). On CUDA
        (T <= 8) one fused launch also routes, the same kernel in the eager and the graphed step."""
        layer, eps = self.layers[i], self.cfg.rms_norm_eps
        if (self._fused_route_ok(i, x) and fused_norm_ok(x, layer.post_norm) and x.dim() == 2
                and x.shape[0] <= fused.ROUTER_MAX_T and x.shape[1] <= fused.ANR_MAX_H
                and a.dtype == x.dtype and a.is_contiguous()):
            x, h, ids, weights = fused.add_norm_router(x, layer.post_norm, eps, layer.router,
                                                       self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob,
                                                       a, *_route_extra(route_out),
                                                       plan=route_out.plan if route_out is not None else None)
            return x, h, (ids, weights)
        x, h = add_rms_norm(x, a, layer.post_norm, eps)
        return x, h, None

    def _moe(self, i: int, layer: DecoderLayer, h: torch.Tensor, routed=None) -> torch.Tensor:
        ids, weights = self.route(i, h) if routed is None else routed
        if self.on_route is not None:
            self.on_route(i, ids, weights)
        return self.moe_out(i, h, self.experts(i, h, ids, weights))

    def _fused_route_ok(self, i: int, h: torch.Tensor) -> bool:
        router, k = self.layers[i].router, self.cfg.num_experts_per_tok
        return (h.is_cuda and fused.enabled("route") and router.dtype == torch.float32 and router.is_cuda
                and router.shape[0] <= fused.ROUTE_MAX_E and k <= min(router.shape[0], fused.ROUTE_MAX_K))

    def moe_out(self, i: int, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Routed experts' sum `out` [T, H] (+ the gated shared expert where the model has one)."""
        layer = self.layers[i]
        if layer.shared is not None:
            gate = torch.sigmoid(h.float() @ layer.shared_gate.float().T)    # [T, 1]
            out = out + (gate * layer.shared(h).float()).to(out.dtype)
        return out

    # ---- one decode token, position on the device (graph-safe) --------------------------------
    def decode_mask(self, pos: torch.Tensor, keys: int) -> torch.Tensor | None:
        """Additive mask [1, 1, 1, keys] in the model dtype: 0 up to pos, -inf after. None on CUDA
        when the fused one-token attention (which reads pos itself) runs every layer's attention;
        Attention.decode builds the mask for a layer that needs it all the same."""
        if pos.is_cuda and self._fused_attention_everywhere():
            return None
        return decode_mask(pos, keys, self.dtype, pos.device)

    def _fused_attention_everywhere(self) -> bool:
        if not isinstance(self.cache, KVCache) or self.dtype != torch.float16:
            return False
        if not (fused.enabled("rope_attn") or fused.enabled("attn")):
            return False
        return all(layer.attn._attn_shapes_ok(self.cache, i) for i, layer in enumerate(self.layers))

    def decode_dense(self, i: int, x: torch.Tensor, pos: torch.Tensor, keys: int, mask: torch.Tensor | None,
                     residual: torch.Tensor | None = None, route_out: RouteOut | None = None):
        """Layer i up to its router for one token: x [1, H] -> (x after attention [1, H],
        normed h [1, H], ids [1, k] int64, weights [1, k] fp32). No host sync, no host values.

        residual [1, H] (fp16 or fp32, e.g. the previous layer's MoE output): x + residual.to(x.dtype)
        is the layer's input, added inside the fused RMSNorm on CUDA. mask may be None (see
        Attention.decode). route_out: buffers the routing is also written into (RouteOut)."""
        layer, eps = self.layers[i], self.cfg.rms_norm_eps
        table = self.rope_table(x.device)                                    # [R, 2, D]
        if residual is not None:
            x, h = add_rms_norm(x, residual, layer.input_norm, eps)
        else:
            h = rms_norm(x, layer.input_norm, eps)
        a = layer.attn.decode(h, i, self.cache, pos, None, keys, mask, table=table)
        x, h, routed = self._post_attn(i, x, a, route_out)
        ids, weights = self.route(i, h, route_out) if routed is None else routed
        return x, h, ids, weights

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for a whole sequence with a fresh cache: ids [T] -> [T, V] fp32."""
        self.new_cache(ids.shape[0])
        return self.forward(ids, 0)

"""Building blocks of the Qwen-MoE family: RMSNorm, rotary embedding, GQA attention with a KV cache.

Legend: T tokens in this call, P past tokens in the cache, H hidden, Hq/Hkv heads, D head_dim,
L keys attended (a bucket of the KV store in a graphed decode step).

CPU tensors take the plain fp32 reference path (the tests compare it with transformers). CUDA
tensors take a path with fewer launches and no host work: fused RMSNorm, one RoPE table per device,
q/k/v as one QPN call where the weights allow it, scaled_dot_product_attention on views of the
cache (no repeat_interleave copies). `Attention.decode` is the T = 1 step whose position is a
device tensor, so a CUDA graph can replay it (hybrid.runtime.graphs).
On CUDA the fused kernels of hybrid.kernels.fused (cuda/fused.cu) replace groups of those torch ops:
RMSNorm (+ residual add), q/k norm + RoPE + KV write, one-token attention. HYBRID_FUSED=0 keeps the
torch ops (A/B measurements).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hybrid.kernels import fused
from hybrid.model.linear import Linear, fused_linear
from hybrid.switches import env_choice, env_flag


BUCKET = 256   # one-token attention reads KV rows in buckets of this many (one graph per bucket)


def attn_keys(start: int, capacity: int, bucket: int = BUCKET) -> int:
    """KV rows a one-token step at position `start` attends: start + 1 rounded up to the bucket."""
    return min(-(-(start + 1) // bucket) * bucket, capacity)


def decode_mask(pos, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1, keys]: 0 up to pos (an int or a device tensor [1]), -inf after."""
    ar = torch.arange(keys, device=device)
    m = torch.zeros(keys, dtype=dtype, device=device).masked_fill_(ar > pos, float("-inf"))
    return m.view(1, 1, 1, keys)


def sdpa_gqa_mode() -> str | None:
    """HYBRID_SDPA_GQA checked: None (unset or auto: by the device), "native" or "expand"; HybridError naming
    it on anything else (a CUDA session checks it when it opens: a bad value is a one-line error)."""
    mode = env_choice("HYBRID_SDPA_GQA", ("auto", "native", "expand"), "auto",
                      "auto, native (enable_gqa) or expand (stride-0 keys)")
    return None if mode == "auto" else mode


def gqa_native(device: torch.device) -> bool:
    """Whether SDPA's enable_gqa is taken by a fused kernel on this device: torch's flash attention, which
    alone supports it, needs sm_80+. Elsewhere (Volta, Turing) enable_gqa sends a prefill to the math
    backend, which builds the [Hq, T, P + T] score matrix in fp32 (4 GiB for a 4096-token chunk of 32 heads)
    where the planner budgets a tiled kernel's workspace. HYBRID_SDPA_GQA=native / expand forces either path."""
    mode = sdpa_gqa_mode()
    if mode is not None:
        return mode == "native"
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def gqa_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, attn_mask=None,
                  is_causal: bool = False) -> torch.Tensor:
    """SDPA of qh [1, Hq, T, D] over kh / vh [1, Hkv, L, D], query head h reading KV head h // (Hq / Hkv)
    -> [1, Hq, T, D]. With gqa_native: enable_gqa. Else each KV head's g = Hq / Hkv query heads become the
    heads of one batch row and its keys and values are expanded to them with stride 0 (no copy), which the
    memory-efficient kernel takes (sm_50+): no score matrix."""
    if gqa_native(qh.device):
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    hq, t, d = qh.shape[1:]
    hkv, keys = kh.shape[1], kh.shape[2]
    g = hq // hkv
    q = qh[0].reshape(hkv, g, t, d)                                            # a view for qh of [T, Hq, D]
    k = kh[0][:, None].expand(hkv, g, keys, d)
    v = vh[0][:, None].expand(hkv, g, keys, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    return out.reshape(1, hq, t, d)


def later_chunk_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of a prefill chunk's T queries at positions start.. over its P + T keys (qh [1, Hq,
    T, D], kh / vh [1, Hkv, P + T, D]): query i sees keys 0..start + i. Through torch's lower-right
    causal bias (no [T, P + T] mask is built; kernels that take the bias need no score matrix), or with
    HYBRID_PREFILL_MASK=1 the boolean mask as before."""
    t, keys = qh.shape[2], kh.shape[2]
    if env_flag("HYBRID_PREFILL_MASK", False):
        pos_k = torch.arange(keys, device=qh.device)
        mask = pos_k[None, :] <= pos_k[start:, None]                           # [T, P+T] True = attend
        return gqa_attention(qh, kh, vh, attn_mask=mask)
    return gqa_attention(qh, kh, vh, attn_mask=causal_lower_right(t, keys))


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """A prefill step's attention: q [T, Hq, D] at positions start.. over the cache's rows keys / vals
    [start + T, Hkv, D] -> [1, Hq, T, D] (causal from position 0; a later chunk through later_chunk_attention)."""
    qh = q.transpose(0, 1)[None]                                              # [1, Hq, T, D]
    kh, vh = keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]           # [1, Hkv, P+T, D]
    if start == 0:
        return gqa_attention(qh, kh, vh, is_causal=True)
    return later_chunk_attention(qh, kh, vh, start)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] -> [..., H], computed in fp32."""
    if x.is_cuda and fused_norm_ok(x, weight):
        return fused.add_rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)[1].view(x.shape)
    if x.is_cuda:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA x fp16/fp32 (contiguous) and an fp32 weight: the fused RMSNorm kernel applies."""
    return (fused.enabled("norm") and x.dtype in (torch.float16, torch.float32) and x.is_contiguous()
            and weight.dtype == torch.float32 and weight.is_cuda and x.dim() >= 1)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """x [T, H], delta [T, H] -> (x2 = x + delta.to(x.dtype), rms_norm(x2)): one kernel on CUDA."""
    if x.is_cuda and x.dim() == 2 and fused_norm_ok(x, weight) and delta.is_contiguous() \
            and delta.dtype in (torch.float16, torch.float32) and delta.shape == x.shape:
        x, h, _ = fused.add_rms_norm(x, weight, eps, delta=delta)
        return x, h
    x = x + delta.to(x.dtype)
    return x, rms_norm(x, weight, eps)


class Rotary:
    """Rotate-half RoPE over the full head dim, inv_freq = theta^(-2i/D)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self._tables: dict = {}

    def cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().to(device)[:, None] * self.inv_freq.to(device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                            # [T, D]
        return emb.cos(), emb.sin()

    def table(self, device: torch.device, n: int) -> torch.Tensor:
        """cos and signed sin for positions 0..n-1 on `device`, built once: [n, 2, D] fp32.

        Row p = (cos(p f), s * sin(p f)) with s = -1 on the first half, so that
        rope(x) = x * cos + swap_halves(x) * signed_sin (the same values as cos_sin)."""
        t = self._tables.get(device)
        if t is None or t.shape[0] < n:
            cos, sin = self.cos_sin(torch.arange(n), device)                                # [n, D]
            half = self.head_dim // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            t = torch.stack((cos, sin), dim=1).contiguous()                                 # [n, 2, D]
            self._tables[device] = t
        return t

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]."""
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        xf = x.float() * cos[:, None, :] + rot.float() * sin[:, None, :]
        return xf.to(x.dtype)

    @staticmethod
    def apply_table(xf: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
        """xf: [T, heads, D] fp32, cs: [T, 2, D] rows of table() -> [T, heads, D] fp32."""
        t, heads, d = xf.shape
        swapped = xf.view(t, heads, 2, d // 2).flip(2).reshape(t, heads, d)
        return torch.addcmul(xf * cs[:, None, 0], swapped, cs[:, None, 1])


class KVCache:
    """Preallocated per-layer K/V: [max_tokens, Hkv, D] each, fp16/fp32 (int8: hybrid.runtime.kv_int8).

    k_store/v_store are the full tensors; k/v are their first max_tokens rows. A new cache may reuse
    the stores of an older, larger one (MoEModel.new_cache on CUDA), so graphs captured on them stay
    valid across generations."""

    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, devices: list[torch.device], stores: tuple | None = None):
        self.max_tokens = max_tokens
        if stores is None:
            stores = ([torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=d) for d in devices],
                      [torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=d) for d in devices])
        self.k_store, self.v_store = stores
        self.k = [s[:max_tokens] for s in self.k_store]
        self.v = [s[:max_tokens] for s in self.v_store]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k_store[0].shape[0]

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
        self._qkv = None          # CUDA: fused q/k/v (a callable x [T, H] -> [T, (Hq+2Hkv)*D])
        self._qk_w = None         # CUDA: q/k norm weights per head [Hq+Hkv, D] fp32
        self._qk_n = None         # CUDA, fused kernels: (q_norm, k_norm) [D] fp32 or (None, None)

    def __call__(self, x: torch.Tensor, layer: int, start: int, cache: KVCache,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and isinstance(cache, KVCache):
            return self._cuda(x, layer, start, cache, cos)
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

    # ---- CUDA path ---------------------------------------------------------------------------
    def _qk_rope(self, x: torch.Tensor, cs: torch.Tensor):
        """x [T, H] -> q, k roped [T, Hq / Hkv, D] and v [T, Hkv, D] (x's dtype); cs [T, 2, D]."""
        t, hq, hkv, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        if self._qkv is None:
            self._qkv = fused_linear([self.q, self.k, self.v])
        qkv = self._qkv(x)                                                   # [T, (Hq+2Hkv)*D]
        qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d).float()           # [T, Hq+Hkv, D]
        if self.q_norm is not None:
            if self._qk_w is None:
                self._qk_w = torch.cat([self.q_norm.float().expand(hq, d), self.k_norm.float().expand(hkv, d)])
            qk = F.rms_norm(qk, (d,), None, self.eps) * self._qk_w           # per-head weights
        qk = Rotary.apply_table(qk, cs).to(x.dtype)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        return qk[:, :hq], qk[:, hq:], v

    def _cuda(self, x, layer: int, start: int, cache: KVCache, table: torch.Tensor) -> torch.Tensor:
        """Eager CUDA step (any T); table: the device's Rotary.table."""
        t = x.shape[0]
        if t == 1 and self.fused_rope_attn_ok(x, cache, layer):
            if start + 1 > cache.max_tokens:
                raise ValueError(f"KV cache full: {start + 1} tokens > capacity {cache.max_tokens}")
            return self.o(self._rope_attn(x, layer, cache, table, None, start, attn_keys(start, cache.capacity)))
        if self.fused_rope_ok(x, cache, layer):
            if start + t > cache.max_tokens:
                raise ValueError(f"KV cache full: {start + t} tokens > capacity {cache.max_tokens}")
            q = self._qk_rope_kv(x, layer, cache, table, None, start)
        else:
            q, k, v = self._qk_rope(x, table[start:start + t])
            cache.write(layer, start, k, v)
        if t == 1:                          # the very kernels of the graphed step (decode)
            keys = attn_keys(start, cache.capacity)
            if self.fused_attn_ok(q, cache, layer):
                return self.o(fused.decode_attn(q.contiguous(), cache.k_store[layer], cache.v_store[layer],
                                                keys, start=start))
            mask = decode_mask(start, keys, x.dtype, x.device)
            return self.o(self._sdpa1(q, cache.k_store[layer][:keys], cache.v_store[layer][:keys], mask))
        out = prefill_attention(q, cache.k[layer][: start + t], cache.v[layer][: start + t], start)
        return self.o(out[0].transpose(0, 1).reshape(t, -1))                  # [T, Hq*D]

    def _sdpa1(self, q, keys, vals, mask):
        """One query token: q [1, Hq, D]; keys/vals [L, Hkv, D]; mask [1, 1, 1, L] additive or None.
        The Hq/Hkv query heads of a KV head become its query rows, so no K/V is copied."""
        g = self.n_heads // self.n_kv
        qh = q.reshape(1, self.n_kv, g, self.head_dim)                        # [1, Hkv, g, D]
        kh, vh = keys.transpose(0, 1)[None], vals.transpose(0, 1)[None]       # [1, Hkv, L, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)     # [1, Hkv, g, D]
        return out.reshape(1, self.n_heads * self.head_dim)

    def decode(self, x: torch.Tensor, layer: int, cache: KVCache, pos: torch.Tensor, cs: torch.Tensor | None,
               keys: int, mask: torch.Tensor | None, table: torch.Tensor | None = None) -> torch.Tensor:
        """One token at device position pos [1] int64 (graph-safe: no host values).

        cs [1, 2, D]: table rows at pos, or None with table [R, 2, D] (the fused kernel reads the row
        at pos itself); keys: rows of the KV store attended (>= pos + 1); mask [1, 1, 1, keys]
        additive (-inf past pos), or None (built here when the torch attention needs it)."""
        if table is not None and self.fused_rope_attn_ok(x, cache, layer):
            return self.o(self._rope_attn(x, layer, cache, table, pos, 0, keys))
        if table is not None and self.fused_rope_ok(x, cache, layer):
            q = self._qk_rope_kv(x, layer, cache, table, pos, 0)
        else:
            q, k, v = self._qk_rope(x, cs if cs is not None else table.index_select(0, pos))
            cache.k_store[layer].index_copy_(0, pos, k)
            cache.v_store[layer].index_copy_(0, pos, v)
        if self.fused_attn_ok(q, cache, layer):
            out = fused.decode_attn(q.contiguous(), cache.k_store[layer], cache.v_store[layer], keys,
                                    pos=pos)
        else:
            mask = decode_mask(pos, keys, x.dtype, x.device) if mask is None else mask
            out = self._sdpa1(q, cache.k_store[layer][:keys], cache.v_store[layer][:keys], mask)
        return self.o(out)

    # ---- CUDA, fused kernels (hybrid.kernels.fused) -----------------------------------------------
    def fused_rope_ok(self, x: torch.Tensor, cache: KVCache, layer: int) -> bool:
        """q/k norm + RoPE + KV write as one kernel: fp16 activations and KV store, D even <= 256."""
        return fused.enabled("rope") and self._rope_shapes_ok(x, cache, layer)

    def fused_attn_ok(self, q: torch.Tensor, cache: KVCache, layer: int) -> bool:
        """One-token attention as one kernel (no mask): fp16, GQA groups and head_dim it supports."""
        return (fused.enabled("attn") and q.is_cuda and q.dim() == 3 and q.shape[0] == 1
                and q.dtype == torch.float16 and self._attn_shapes_ok(cache, layer))

    def fused_rope_attn_ok(self, x: torch.Tensor, cache: KVCache, layer: int) -> bool:
        """One token's q/k norm + RoPE + KV write + attention as one kernel."""
        return (fused.enabled("rope_attn") and x.dim() == 2 and x.shape[0] == 1
                and self._rope_shapes_ok(x, cache, layer) and self._attn_shapes_ok(cache, layer))

    def _rope_shapes_ok(self, x: torch.Tensor, cache: KVCache, layer: int) -> bool:
        return (x.dtype == torch.float16 and x.is_cuda and cache.k_store[layer].dtype == torch.float16
                and self.head_dim % 2 == 0 and self.head_dim <= fused.ROPE_MAX_D)

    def _attn_shapes_ok(self, cache: KVCache, layer: int) -> bool:
        g, d = self.n_heads // self.n_kv, self.head_dim
        return (cache.k_store[layer].dtype == torch.float16 and self.n_heads % self.n_kv == 0
                and g <= fused.ATT_MAX_G and g * d <= fused.ATT_MAX_Q and d % 8 == 0
                and d <= fused.ROPE_MAX_D)

    def _qk_inputs(self, x: torch.Tensor):
        """x [T, H] -> (qkv [T, (Hq+2Hkv)*D] contiguous, (q_norm, k_norm) [D] fp32 or Nones)."""
        if self._qkv is None:
            self._qkv = fused_linear([self.q, self.k, self.v])
        if self._qk_n is None:
            self._qk_n = ((None, None) if self.q_norm is None else
                          (self.q_norm.float().reshape(-1).contiguous(), self.k_norm.float().reshape(-1).contiguous()))
        return self._qkv(x).contiguous(), self._qk_n

    def _rope_attn(self, x: torch.Tensor, layer: int, cache: KVCache, table: torch.Tensor,
                   pos: torch.Tensor | None, start: int, keys: int) -> torch.Tensor:
        """x [1, H] -> attention output [1, Hq*D] fp16 (K/V row written), one fused kernel."""
        qkv, (qn, kn) = self._qk_inputs(x)
        return fused.rope_attn(qkv, qn, kn, table, cache.k_store[layer], cache.v_store[layer], self.n_heads,
                               self.n_kv, self.head_dim, self.eps, keys, pos=pos, start=start)

    def _qk_rope_kv(self, x: torch.Tensor, layer: int, cache: KVCache, table: torch.Tensor,
                    pos: torch.Tensor | None, start: int) -> torch.Tensor:
        """x [T, H] -> q [T, Hq, D] fp16; k, v written into the KV store at pos (device) or start."""
        qkv, qk_n = self._qk_inputs(x)                                       # [T, (Hq+2Hkv)*D]
        return fused.qk_rope_kv(qkv, *qk_n, table, cache.k_store[layer], cache.v_store[layer],
                                self.n_heads, self.n_kv, self.head_dim, self.eps, pos=pos, start=start)

"""The tiny Qwen3-MoE + MTP model as plain torch modules, for training (tools/train_tiny.py).

Legend: B batch, S sequence, T tokens (B*S), H hidden, E experts, K top-k, I expert intermediate,
C per-expert capacity of one padded batched matmul, V vocabulary.

Math follows Hugging Face's Qwen3MoeForCausalLM exactly (RMSNorm in fp32, q/k norm per head,
rotate-half RoPE, softmax router -> top-k -> renormalise, SwiGLU experts). Experts are stored
stacked ([E, 2I, H] gate|up, [E, H, I] down) for speed and exported under the per-expert
Hugging Face names by `hf_state_dict`. MTP (DeepSeek-V3 / Qwen3-Next style):
    h'_t = eh_proj([hnorm(h_t); enorm(embed(x_{t+1}))])  ->  one block (attention + dense SwiGLU)
    -> mtp.norm -> shared (tied) head  ->  logits for x_{t+2}
where h_t is the main model's last-layer output BEFORE model.norm.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    top_k: int = 4
    moe_intermediate_size: int = 256
    mtp_intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 256:
                raise ValueError(f"TinyConfig.{name}={getattr(self, name)} must be a multiple of 256")
        if (self.num_heads * self.head_dim) % 256:
            raise ValueError("TinyConfig: attention width num_heads*head_dim must be a multiple of 256")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("TinyConfig: num_heads must be a multiple of num_kv_heads")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError("TinyConfig: top_k must be in 1..num_experts")

    def hf_config(self, bos_id: int, eos_id: int) -> dict:
        """config.json for transformers' Qwen3MoeConfig (+ num_nextn_predict_layers for MTP)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.mtp_intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.init_std, "rms_norm_eps": self.rms_norm_eps,
            "use_cache": True, "tie_word_embeddings": True, "rope_theta": self.rope_theta,
            "rope_scaling": None, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": self.num_layers, "attention_dropout": 0.0,
            "decoder_sparse_step": 1, "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts_per_tok": self.top_k, "num_experts": self.num_experts,
            "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
            "mlp_only_layers": [], "bos_token_id": bos_id, "eos_token_id": eos_id,
            "pad_token_id": eos_id, "torch_dtype": "bfloat16",
            "num_nextn_predict_layers": 1,
        }

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_tables(cfg: TinyConfig, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, D] in fp32, Hugging Face's default rope (cat(freqs, freqs))."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    freqs = torch.arange(seq, device=device).float()[:, None] * inv[None, :]   # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                    # [S, D]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_norm(self.q_proj(x).view(b, s, c.num_heads, c.head_dim)).transpose(1, 2)     # [B,nh,S,D]
        k = self.k_norm(self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim)).transpose(1, 2)  # [B,nkv,S,D]
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cs, sn = cos[:s].to(q.dtype), sin[:s].to(q.dtype)
        q = q * cs + _rotate_half(q) * sn
        k = k * cs.to(k.dtype) + _rotate_half(k) * sn.to(k.dtype)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = q.to(v.dtype), k.to(v.dtype), v
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim))


class DenseMLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Stored as `mlp.gate.weight` [E, H]; runs in fp32 (autocast off)."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.top_k

    def forward(self, x: torch.Tensor):
        """x [T, H] -> probs [T, E] fp32, top_w [T, K] fp32 (renormalised), top_i [T, K]."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())          # [T, E]
        probs = logits.softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)                   # [T, K]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w, top_i


def run_experts(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Sparse MoE by sorting (token, slot) pairs per expert into a padded [E, C, H] batch.

    x [T, H], top_i/top_w [T, K], w_gate_up [E, 2I, H], w_down [E, H, I] -> [T, H].
    Every scatter/gather uses unique indices, so results do not depend on atomics order.
    """
    t, k = top_i.shape
    e, h = w_gate_up.shape[0], x.shape[1]
    flat = top_i.reshape(-1)                                             # [T*K]
    order = torch.argsort(flat, stable=True)                             # [T*K]
    sorted_e = flat[order]
    counts = torch.bincount(flat, minlength=e)                           # [E]
    cap = int(counts.max().item())                                       # C (one sync per layer)
    starts = torch.cumsum(counts, 0) - counts
    slot = sorted_e * cap + (torch.arange(t * k, device=x.device) - starts[sorted_e])  # [T*K] in E*C
    x_rep = x[:, None, :].expand(t, k, h).reshape(t * k, h)[order]       # [T*K, H] sorted
    buf = x.new_zeros(e * cap, h).index_copy(0, slot, x_rep).view(e, cap, h)   # [E, C, H]
    gu = torch.bmm(buf, w_gate_up.transpose(1, 2))                       # [E, C, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, w_down.transpose(1, 2))                 # [E, C, H]
    y_sorted = y.reshape(e * cap, h)[slot]                               # [T*K, H]
    y_sorted = y_sorted * top_w.reshape(-1)[order, None].to(y_sorted.dtype)
    y_flat = y_sorted.new_zeros(t * k, h).index_copy(0, order, y_sorted)  # unsort
    return y_flat.view(t, k, h).sum(dim=1)                               # [T, H]


class SparseMoE(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))   # rows [0,I) gate, [I,2I) up
        self.w_down = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor):
        """x [B, S, H] -> (y [B, S, H], (probs [T,E], top_w [T,K], top_i [T,K]))."""
        xt = x.reshape(-1, x.shape[-1])
        probs, top_w, top_i = self.gate(xt)
        w_gu, w_d = self.w_gate_up, self.w_down
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            xt, w_gu, w_d = xt.to(dt), w_gu.to(dt), w_d.to(dt)
        y = run_experts(xt, top_i, top_w, w_gu, w_d)
        return y.view(x.shape), (probs, top_w, top_i)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, dense: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dense = dense
        self.mlp = DenseMLP(cfg.hidden_size, cfg.mtp_intermediate_size) if dense else SparseMoE(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if self.dense:
            return x + self.mlp(h), None
        y, route = self.mlp(h)
        return x + y, route


class Trunk(nn.Module):
    """`model.*`: embed_tokens, layers, norm."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTP(nn.Module):
    """`mtp.*`: hnorm, enorm, eh_proj [H, 2H], layers.0 (dense block), norm."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        h = cfg.hidden_size
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Block(cfg, dense=True)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class TinyMoE(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Trunk(cfg)
        self.mtp = MTP(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * (self.cfg.num_layers + 1))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.model.embed_tokens.weight)             # tied lm_head, [.., V]

    def forward(self, ids: torch.Tensor, mtp: bool = True):
        """ids [B, S] -> dict(logits [B,S,V], mtp_logits [B,S-1,V] (predicts x_{t+2}), routes)."""
        s = ids.shape[1]
        cos, sin = rope_tables(self.cfg, s, ids.device)
        emb = self.model.embed_tokens(ids)                                # [B, S, H]
        x, routes = emb, []
        for layer in self.model.layers:
            x, route = layer(x, cos, sin)
            routes.append(route)
        out = {"logits": self.head(self.model.norm(x)), "routes": routes, "hidden": x}
        if mtp and s > 1:
            out["mtp_logits"] = self.mtp_forward(x[:, :-1], emb[:, 1:], cos, sin)
        return out

    def mtp_forward(self, h: torch.Tensor, next_emb: torch.Tensor, cos, sin) -> torch.Tensor:
        """h [B, S', H] (pre-norm last hidden at t), next_emb [B, S', H] (embed of x_{t+1})."""
        m = self.mtp
        z = m.eh_proj(torch.cat([m.hnorm(h), m.enorm(next_emb)], dim=-1))  # [B, S', H]
        z, _ = m.layers[0](z, cos, sin)
        return self.head(m.norm(z))


def aux_loss(routes, num_experts: int) -> torch.Tensor:
    """Switch/Qwen3 load-balancing loss, averaged over layers: E * sum_e f_e * P_e."""
    losses = []
    for probs, _, top_i in routes:
        t = probs.shape[0]
        frac = torch.bincount(top_i.reshape(-1), minlength=num_experts).float() / t   # [E]
        losses.append(num_experts * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def hf_state_dict(model: TinyMoE) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3MoeForCausalLM names (+ mtp.*), per-expert tensors split out."""
    cfg, out = model.cfg, {}
    i = cfg.moe_intermediate_size
    for name, p in model.state_dict().items():
        p = p.detach()
        if name.endswith("mlp.w_gate_up"):
            pre = name[: -len("w_gate_up")]
            for e in range(cfg.num_experts):
                out[f"{pre}experts.{e}.gate_proj.weight"] = p[e, :i].contiguous()
                out[f"{pre}experts.{e}.up_proj.weight"] = p[e, i:].contiguous()
        elif name.endswith("mlp.w_down"):
            pre = name[: -len("w_down")]
            for e in range(cfg.num_experts):
                out[f"{pre}experts.{e}.down_proj.weight"] = p[e].contiguous()
        else:
            out[name] = p.contiguous()
    return out


def load_hf_state_dict(model: TinyMoE, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of hf_state_dict (values cast to the model's parameter dtype)."""
    cfg, sd = model.cfg, {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.w_gate_up"):
            pre = name[: -len("w_gate_up")]
            sd[name] = torch.stack([torch.cat([tensors[f"{pre}experts.{e}.gate_proj.weight"],
                                               tensors[f"{pre}experts.{e}.up_proj.weight"]])
                                    for e in range(cfg.num_experts)])
        elif name.endswith("mlp.w_down"):
            pre = name[: -len("w_down")]
            sd[name] = torch.stack([tensors[f"{pre}experts.{e}.down_proj.weight"] for e in range(cfg.num_experts)])
        else:
            sd[name] = tensors[name]
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in sd.items()})

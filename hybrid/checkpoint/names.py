"""One name-mapping table from roles to Hugging Face tensor names, per architecture.

Roles are what the runtime asks for; names are what the checkpoint stores (without `.weight`).
"""
from __future__ import annotations

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PROJ = ("gate", "up", "down")

_DENSE = {                                   # every architecture here: embeddings, norms, attention
    "embed": "model.embed_tokens",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    "attn": "model.layers.{L}.self_attn.{p}",
    "input_norm": "model.layers.{L}.input_layernorm",
    "post_norm": "model.layers.{L}.post_attention_layernorm",
}
_QWEN_MOE = {                                # Qwen2/3-MoE's router and experts
    "router": "model.layers.{L}.mlp.gate",
    "expert": "model.layers.{L}.mlp.experts.{E}.{p}",
    "expert_proj": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}

ARCH_NAMES = {
    "qwen3_moe": {**_DENSE, **_QWEN_MOE,
                  "q_norm": "model.layers.{L}.self_attn.q_norm",
                  "k_norm": "model.layers.{L}.self_attn.k_norm"},
    "qwen2_moe": {**_DENSE, **_QWEN_MOE,
                  "shared_expert": "model.layers.{L}.mlp.shared_expert.{p}",
                  "shared_expert_gate": "model.layers.{L}.mlp.shared_expert_gate"},
    "mixtral": {**_DENSE,
                "router": "model.layers.{L}.block_sparse_moe.gate",
                "expert": "model.layers.{L}.block_sparse_moe.experts.{E}.{p}",
                "expert_proj": {"gate": "w1", "up": "w3", "down": "w2"}},
}

# Modules that stay unquantized by default (ModelOpt's defaults): router, shared-expert gate,
# lm_head unless a recipe lists it, norms and embeddings (not Linears).
DEFAULT_EXCLUDE = ("lm_head", "*mlp.gate", "*block_sparse_moe.gate", "*shared_expert_gate")


class Names:
    """Tensor names for one architecture: `names.attn(3, "q_proj")` -> 'model.layers.3.self_attn.q_proj'."""

    def __init__(self, model_type: str):
        self.model_type = model_type
        self.t = ARCH_NAMES[model_type]

    def _fmt(self, key: str, **kw) -> str:
        return self.t[key].format(**kw)

    def embed(self) -> str:
        return self.t["embed"]

    def final_norm(self) -> str:
        return self.t["final_norm"]

    def lm_head(self) -> str:
        return self.t["lm_head"]

    def attn(self, layer: int, proj: str) -> str:
        return self._fmt("attn", L=layer, p=proj)

    def layer(self, key: str, layer: int) -> str:
        """key in input_norm, post_norm, q_norm, k_norm, router, shared_expert_gate."""
        return self._fmt(key, L=layer)

    def expert(self, layer: int, expert: int, proj: str) -> str:
        """proj in gate, up, down (the role; mapped to w1/w3/w2 for mixtral)."""
        return self._fmt("expert", L=layer, E=expert, p=self.t["expert_proj"][proj])

    def shared_expert(self, layer: int, proj: str) -> str:
        return self._fmt("shared_expert", L=layer, p=f"{proj}_proj")

    @property
    def has_shared_expert(self) -> bool:
        return "shared_expert" in self.t

    @property
    def has_qk_norm(self) -> bool:
        return "q_norm" in self.t


def shared_scale_groups(names: Names, num_layers: int, num_experts: int) -> list[tuple[str, ...]]:
    """Linears that share an input and so share NVFP4 weight_scale_2: q/k/v, each expert's gate/up."""
    groups: list[tuple[str, ...]] = []
    for layer in range(num_layers):
        groups.append(tuple(names.attn(layer, p) for p in ("q_proj", "k_proj", "v_proj")))
        for e in range(num_experts):
            groups.append((names.expert(layer, e, "gate"), names.expert(layer, e, "up")))
        if names.has_shared_expert:
            groups.append((names.shared_expert(layer, "gate"), names.shared_expert(layer, "up")))
    return groups

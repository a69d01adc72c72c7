"""Quantization recipes: which Linear of a model gets which storage type, and the config that says so.

Recipes (ModelOpt names in brackets):
    nvfp4  every Linear NVFP4 [NVFP4] except the default exclusions (router, shared-expert gate,
           lm_head); norms and embeddings are not Linears and stay as they are.
    fp8    the same Linears as FP8 per-tensor [FP8].
    mixed  attention projections FP8, routed and shared experts and lm_head NVFP4, router /
           shared-expert gate / norms / embeddings unquantized [MIXED_PRECISION] — the shape of
           NVIDIA's mixed FP4/FP8 releases.

Legend: N out features, K in features, H hidden, I expert intermediate, E experts.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from hybrid import __version__
from hybrid.checkpoint.formats import GROUP
from hybrid.checkpoint.names import ATTN, DEFAULT_EXCLUDE, Names
from hybrid.errors import HybridError
from hybrid.model.config import ModelConfig

NVFP4 = "NVFP4"
FP8 = "FP8"
MIXED = "MIXED_PRECISION"
FORMATS = ("modelopt", "compressed-tensors")
CT_FORMAT = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class LinearSpec:
    """One Linear of the model: its module name, role and weight shape [N, K]."""

    name: str
    role: str               # attn | expert | shared_expert | router | shared_expert_gate | lm_head
    shape: tuple[int, int]
    bias: bool = False


def linear_specs(cfg: ModelConfig) -> list[LinearSpec]:
    """Every Linear the architecture has, in checkpoint order (layer by layer)."""
    names = Names(cfg.model_type)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    out = {"q_proj": cfg.q_dim, "k_proj": cfg.kv_dim, "v_proj": cfg.kv_dim, "o_proj": h}
    specs: list[LinearSpec] = []
    for layer in range(cfg.num_hidden_layers):
        for p in ATTN:
            k = cfg.q_dim if p == "o_proj" else h
            specs.append(LinearSpec(names.attn(layer, p), "attn", (out[p], k),
                                    bias=cfg.attention_bias and p != "o_proj"))
        specs.append(LinearSpec(names.layer("router", layer), "router", (cfg.num_experts, h)))
        for e in range(cfg.num_experts):
            for p, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                specs.append(LinearSpec(names.expert(layer, e, p), "expert", shape))
        if names.has_shared_expert and cfg.shared_expert_intermediate_size:
            si = cfg.shared_expert_intermediate_size
            for p, shape in (("gate", (si, h)), ("up", (si, h)), ("down", (h, si))):
                specs.append(LinearSpec(names.shared_expert(layer, p), "shared_expert", shape))
            specs.append(LinearSpec(names.layer("shared_expert_gate", layer), "shared_expert_gate", (1, h)))
    if not cfg.tie_word_embeddings:
        specs.append(LinearSpec(names.lm_head(), "lm_head", (cfg.vocab_size, h)))
    return specs


def matches(module: str, patterns) -> bool:
    """ModelOpt-style exclusion: exact name or `*` wildcard over the whole module name."""
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns)


@dataclass(frozen=True)
class Recipe:
    """Role -> quant algo ("NVFP4" | "FP8"), minus modules matching `exclude`."""

    name: str
    quant_algo: str                          # hf_quant_config quant_algo
    roles: dict[str, str] = field(default_factory=dict)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE

    def algo(self, spec: LinearSpec, extra_exclude=()) -> str | None:
        """The algo this recipe gives one Linear, or None to keep it unquantized."""
        if matches(spec.name, self.exclude) or matches(spec.name, extra_exclude):
            return None
        return self.roles.get(spec.role)

    def assign(self, specs: list[LinearSpec], extra_exclude=()) -> dict[str, str | None]:
        """module name -> "NVFP4" | "FP8" | None; refuses Linears NVFP4 cannot pack."""
        plan = {s.name: self.algo(s, extra_exclude) for s in specs}
        for s in specs:
            if plan[s.name] == NVFP4 and s.shape[1] % GROUP:
                plan[s.name] = None  # in-features not a multiple of 16: keep it dense
        return plan


_ALL = {"attn": None, "expert": None, "shared_expert": None}
RECIPES = {
    "nvfp4": Recipe("nvfp4", NVFP4, {r: NVFP4 for r in _ALL}),
    "fp8": Recipe("fp8", FP8, {r: FP8 for r in _ALL}),
    "mixed": Recipe("mixed", MIXED, {"attn": FP8, "expert": NVFP4, "shared_expert": NVFP4, "lm_head": NVFP4},
                    tuple(p for p in DEFAULT_EXCLUDE if p != "lm_head")),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise HybridError(f"--recipe {name!r}: unknown; expected one of {', '.join(RECIPES)}")
    return RECIPES[name]


# ----- the configs that declare a plan ------------------------------------------------------------
def _excluded_patterns(recipe: Recipe, plan: dict[str, str | None], extra_exclude=()) -> list[str]:
    """Wildcard patterns (the recipe's, and the user's) that cover the unquantized Linears."""
    dense = [m for m, a in plan.items() if a is None]
    pats = [p for p in (*recipe.exclude, *extra_exclude) if any(matches(m, (p,)) for m in dense)]
    covered = [m for m in dense if not matches(m, pats)]   # e.g. Linears NVFP4 could not pack
    return sorted(set(pats)) + covered


def modelopt_quantization(recipe: Recipe, plan: dict[str, str | None], extra_exclude=()) -> dict:
    """The `quantization` section of hf_quant_config.json for this plan."""
    algos = {a for a in plan.values() if a is not None}
    q: dict = {"quant_algo": recipe.quant_algo if len(algos) != 1 else algos.pop(),
               "kv_cache_quant_algo": None}
    if q["quant_algo"] in (NVFP4, MIXED):
        q["group_size"] = GROUP
    q["exclude_modules"] = _excluded_patterns(recipe, plan, extra_exclude)
    if q["quant_algo"] == MIXED:
        q["quantized_layers"] = {m: ({"quant_algo": NVFP4, "group_size": GROUP} if a == NVFP4
                                     else {"quant_algo": FP8})
                                 for m, a in plan.items() if a is not None}
    return q


def producer() -> dict:
    """ModelOpt layout; the version names the tool that wrote it (not NVIDIA ModelOpt itself)."""
    return {"name": "modelopt", "version": f"hybrid-{__version__}"}


def hf_quant_config(recipe: Recipe, plan, extra_exclude=()) -> dict:
    return {"producer": producer(), "quantization": modelopt_quantization(recipe, plan, extra_exclude)}


def modelopt_quantization_config(recipe: Recipe, plan, extra_exclude=()) -> dict:
    """config.json `quantization_config` (quant_method "modelopt"); `ignore` mirrors exclude_modules."""
    q = modelopt_quantization(recipe, plan, extra_exclude)
    return {"quant_method": "modelopt", **q, "ignore": list(q["exclude_modules"]), "producer": producer()}


def compressed_tensors_config(plan: dict[str, str | None]) -> dict:
    """config.json `quantization_config` for compressed-tensors nvfp4-pack-quantized, weight-only."""
    if any(a not in (None, NVFP4) for a in plan.values()):
        raise ValueError("compressed-tensors output supports NVFP4 only")
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": GROUP, "dynamic": False, "scale_dtype": "float8_e4m3fn"}
    return {
        "quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": CT_FORMAT}},
        "ignore": sorted(m for m, a in plan.items() if a is None),
        "kv_cache_scheme": None,
    }

"""Expert-popularity profiles: `profiles/<model>.experts.json` (how often the router picks each expert).

File (written by `hybrid-profile`; <model> = the model folder's name):

    {
      "schema": 1,
      "kind": "expert-popularity",
      "model": "Qwen3-30B-A3B-NVFP4",       # folder name it was measured on
      "model_type": "qwen3_moe",
      "num_layers": 48, "num_experts": 128, "top_k": 8,
      "tokens": 200000,                      # tokens routed (prefill + decode)
      "counts": [[...128 ints...], ...48 rows],
      "source": {"command": "...", "git_sha": "...", "machine": "...", "prompts": "..."}
    }

counts[l][e] = how many of those tokens chose expert e among their top-k in layer l; so each row
sums to tokens * top_k for a full profile and counts[l, e] / tokens is the probability that a token
uses expert e of layer l. "source" is free-form provenance and optional.

One loader for every reader: load_profile(path) checks only what the expert cache needs (the
fields above from "model" to "counts", counts [L, E], signs); load_profile(path, cfg) is strict, as
the planner needs: the schema above exactly, layers / experts / top_k those of `cfg`, every row
summing to tokens * top_k.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid.model.config import ModelConfig
from hybrid.planner.profile import ProfileError, read_json

KEYS = ("schema", "kind", "model", "model_type", "num_layers", "num_experts", "top_k", "tokens",
        "counts", "source")

__all__ = ["ExpertProfile", "ProfileError", "check_strict", "load_profile", "profile_path", "save_profile"]


@dataclass
class ExpertProfile:
    """Routing counts per layer and expert. counts: int64 [L, E]."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    tokens: int
    counts: np.ndarray

    def __post_init__(self) -> None:
        self.counts = np.asarray(self.counts, dtype=np.int64)
        where = f"expert profile {self.model!r}"
        if self.counts.shape != (self.num_layers, self.num_experts):
            raise ProfileError(f"{where}: counts has shape {self.counts.shape}, expected "
                               f"[num_layers={self.num_layers}, num_experts={self.num_experts}]")
        if not 0 < self.top_k <= self.num_experts or self.tokens < 0 or (self.counts < 0).any():
            raise ProfileError(f"{where}: need 0 < top_k <= num_experts, tokens >= 0, counts >= 0")

    def probs(self, layer: int) -> np.ndarray:
        """P(a token routes to expert e) for one layer: float64 [E] (zeros if no tokens)."""
        return self.counts[layer] / max(self.tokens, 1)

    def top(self, layer: int, n: int) -> list[int]:
        """The n most used experts of a layer, by count descending then id ascending."""
        order = np.lexsort((np.arange(self.num_experts), -self.counts[layer]))
        return [int(e) for e in order[:max(n, 0)]]

    def to_dict(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "tokens": self.tokens, "counts": self.counts.tolist()}

    @classmethod
    def from_dict(cls, d: dict, where: str = "expert profile", cfg: ModelConfig | None = None) -> "ExpertProfile":
        """Lenient; with `cfg`, strict against that model (check_strict; "model" is then optional)."""
        if cfg is not None:
            check_strict(d, cfg, where)
            d = {"model": "", **d}
        try:
            return cls(model=str(d["model"]), num_layers=int(d["num_layers"]),
                       num_experts=int(d["num_experts"]), top_k=int(d["top_k"]),
                       tokens=int(d["tokens"]), counts=np.asarray(d["counts"], dtype=np.int64))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: bad or missing field ({exc})") from None


def check_strict(d, cfg: ModelConfig, where: str) -> None:
    """The file schema exactly, for the model `cfg`: known keys, schema 1 and kind, layers / experts
    / top_k those of cfg, tokens > 0, counts [L][E] non-negative integers, each row = tokens x top_k."""
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        raise ProfileError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(KEYS)}")
    if d.get("schema") != 1 or d.get("kind") != "expert-popularity":
        raise ProfileError(f"{where}: expected schema 1 and kind 'expert-popularity'")
    want = {"num_layers": cfg.num_hidden_layers, "num_experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok}
    for k, v in want.items():
        if d.get(k) != v:
            raise ProfileError(f"{where}: {k} is {d.get(k)!r} but the model has {v}")
    tokens = d.get("tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        raise ProfileError(f"{where}: tokens must be a positive integer")
    _check_counts(d.get("counts"), want, tokens, where)


def _check_counts(counts, want: dict, tokens: int, where: str) -> None:
    L, E, k = want["num_layers"], want["num_experts"], want["top_k"]
    if not isinstance(counts, list) or len(counts) != L:
        raise ProfileError(f"{where}: counts must be a list of {L} rows (one per layer)")
    for layer, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != E:
            raise ProfileError(f"{where}: counts[{layer}] must have {E} entries (one per expert)")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in row):
            raise ProfileError(f"{where}: counts[{layer}] must hold non-negative integers")
        total = sum(row)
        if total != tokens * k:
            raise ProfileError(f"{where}: counts[{layer}] sums to {total}, expected tokens x top_k "
                               f"= {tokens * k}")


def profile_path(model: str, root: str | Path = "profiles") -> Path:
    """Where the profile of `model` lives: <root>/<model>.experts.json."""
    return Path(root) / f"{model}.experts.json"


def load_profile(path: str | Path, cfg: ModelConfig | None = None) -> ExpertProfile:
    """Read `path` (see the module doc); with `cfg`, strictly for that model."""
    return ExpertProfile.from_dict(read_json(Path(path)), str(path), cfg)


def profile_file_dict(model_name: str, model_type: str, counts: np.ndarray, tokens: int, top_k: int,
                      source: dict) -> dict:
    """The file both readers take (this module and hybrid.planner.popularity): hybrid-profile's and
    hybrid-run --save-expert-profile's."""
    prof = ExpertProfile(model_name, counts.shape[0], counts.shape[1], top_k, tokens, counts)
    return {"schema": 1, "kind": "expert-popularity", "model_type": model_type, **prof.to_dict(),
            "source": source}


def save_profile(profile: ExpertProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict()) + "\n")
    return path

"""Expert-popularity profiles: `profiles/<model>.experts.json` (how often the router picks each expert).

Format (the planner reads the same file):
    {"model": str, "num_layers": L, "num_experts": E, "top_k": k, "tokens": n,
     "counts": [[routing count per expert] per layer]}          # [L, E] ints
`tokens` is how many tokens were routed, so counts[l].sum() == tokens * top_k for a full profile
and counts[l, e] / tokens is the probability that a token uses expert e of layer l.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid.errors import HybridError


class ProfileError(HybridError):
    """An expert-popularity profile is missing or malformed."""


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
    def from_dict(cls, d: dict, where: str = "expert profile") -> "ExpertProfile":
        try:
            return cls(model=str(d["model"]), num_layers=int(d["num_layers"]),
                       num_experts=int(d["num_experts"]), top_k=int(d["top_k"]),
                       tokens=int(d["tokens"]), counts=np.asarray(d["counts"], dtype=np.int64))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: bad or missing field ({exc})") from None


def profile_path(model: str, root: str | Path = "profiles") -> Path:
    """Where the profile of `model` lives: <root>/<model>.experts.json."""
    return Path(root) / f"{model}.experts.json"


def load_profile(path: str | Path) -> ExpertProfile:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read expert profile ({exc})") from None
    return ExpertProfile.from_dict(d, where=str(path))


def save_profile(profile: ExpertProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict()) + "\n")
    return path

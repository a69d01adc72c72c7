"""Expert popularity: how often each expert is routed to, per layer; sets the expected hit rate.

The file is `profiles/<model>.experts.json` (written by `hybrid-profile`; <model> = the model
folder's name); its format and its one loader are hybrid.experts.popularity, read here in its
strict mode (schema, model shape and row sums checked). Without a popularity file the planner
assumes uniform routing (hit rate = slots / experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybrid.model.config import ModelConfig

# hybrid.experts.popularity imports hybrid.planner.profile (ProfileError, read_json): it is imported
# where it is used, so that importing either package first works.


@dataclass(frozen=True)
class Popularity:
    """shares[l][e]: fraction of layer l's routing choices that went to expert e (rows sum to 1)."""

    model: str
    shares: tuple[tuple[float, ...], ...]
    tokens: int
    path: str = ""

    @classmethod
    def from_profile(cls, prof, path: str = "") -> "Popularity":
        """From a strictly loaded hybrid.experts.popularity.ExpertProfile (rows sum to tokens x top_k > 0)."""
        totals = prof.counts.sum(axis=1, keepdims=True)                       # [L, 1]
        shares = tuple(tuple(row) for row in (prof.counts / totals).tolist())
        return cls(prof.model, shares, prof.tokens, path)

    @classmethod
    def from_dict(cls, d: dict, cfg: ModelConfig, where: str = "experts.json") -> "Popularity":
        from hybrid.experts.popularity import ExpertProfile

        return cls.from_profile(ExpertProfile.from_dict(d, where, cfg), where)

    def layer(self, layer: int) -> tuple[float, ...]:
        return self.shares[layer]


def load_popularity(path: str | Path, cfg: ModelConfig) -> Popularity:
    from hybrid.experts.popularity import load_profile

    return Popularity.from_profile(load_profile(path, cfg), str(path))


def find_popularity(model_dir: str | Path) -> Path | None:
    """profiles/<folder name>.experts.json in the profile search path, if there is one."""
    from hybrid.planner.profile import profile_dirs

    name = Path(model_dir).resolve().name
    for d in profile_dirs():
        cand = d / f"{name}.experts.json"
        if cand.is_file():
            return cand
    return None


def allot_slots(layers: range, slots: int, num_experts: int,
                pop: Popularity | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Spread a card's slots over its layers -> (slots per layer, hit rate per layer).

    With popularity: the card's `slots` most-chosen experts (over all its layers) are cached,
    which maximizes expected hits; hit rate of a layer = the shares of its cached experts.
    Without: an even spread, hit rate = slots_l / E.
    """
    n = len(layers)
    slots = min(slots, n * num_experts)
    if pop is None:
        per = [slots // n + (i < slots % n) for i in range(n)] if n else []
        return tuple(per), tuple(s / num_experts for s in per)
    ranked = sorted(((s, i) for i, layer in enumerate(layers) for s in pop.layer(layer)),
                    key=lambda t: -t[0])[:slots]
    per, hit = [0] * n, [0.0] * n
    for share, i in ranked:
        per[i] += 1
        hit[i] += share
    return tuple(per), tuple(min(h, 1.0) for h in hit)

"""Expert popularity: how often each expert is routed to, per layer; sets the expected hit rate.

File `profiles/<model>.experts.json` (written by `hybrid-profile`; <model> = the model folder's name):

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
sums to tokens * top_k. "source" is free-form provenance and optional. Without a popularity file
the planner assumes uniform routing (hit rate = slots / experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybrid.model.config import ModelConfig
from hybrid.planner.profile import ProfileError, read_json

KEYS = ("schema", "kind", "model", "model_type", "num_layers", "num_experts", "top_k", "tokens",
        "counts", "source")


@dataclass(frozen=True)
class Popularity:
    """shares[l][e]: fraction of layer l's routing choices that went to expert e (rows sum to 1)."""

    model: str
    shares: tuple[tuple[float, ...], ...]
    tokens: int
    path: str = ""

    @classmethod
    def from_dict(cls, d: dict, cfg: ModelConfig, where: str = "experts.json") -> "Popularity":
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
        return cls(str(d.get("model", "")), _shares(d.get("counts"), want, tokens, where), tokens, where)

    def layer(self, layer: int) -> tuple[float, ...]:
        return self.shares[layer]


def _shares(counts, want: dict, tokens: int, where: str) -> tuple[tuple[float, ...], ...]:
    L, E, k = want["num_layers"], want["num_experts"], want["top_k"]
    if not isinstance(counts, list) or len(counts) != L:
        raise ProfileError(f"{where}: counts must be a list of {L} rows (one per layer)")
    rows = []
    for layer, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != E:
            raise ProfileError(f"{where}: counts[{layer}] must have {E} entries (one per expert)")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in row):
            raise ProfileError(f"{where}: counts[{layer}] must hold non-negative integers")
        total = sum(row)
        if total != tokens * k:
            raise ProfileError(f"{where}: counts[{layer}] sums to {total}, expected tokens x top_k "
                               f"= {tokens * k}")
        rows.append(tuple(c / total for c in row))
    return tuple(rows)


def load_popularity(path: str | Path, cfg: ModelConfig) -> Popularity:
    return Popularity.from_dict(read_json(Path(path)), cfg, str(path))


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

"""`--layer-split auto`: try every split, keep the one with the best predicted tok/s that fits."""
from __future__ import annotations

import itertools
from dataclasses import replace

from hybrid.errors import PlanError
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import Plan
from hybrid.planner.popularity import Popularity
from hybrid.planner.profile import HardwareProfile

MAX_AUTO_CARDS = 3
TIE = 0.01          # predicted tok/s this close to the best count as equal


def candidate_splits(num_layers: int, cards: int) -> list[tuple[int, ...]]:
    """Every split that gives each card at least one layer (cards <= MAX_AUTO_CARDS)."""
    if cards > MAX_AUTO_CARDS:
        raise PlanError(f"--layer-split auto searches up to {MAX_AUTO_CARDS} cards; "
                        f"give the {cards - 1} boundaries explicitly")
    if cards > num_layers:
        raise PlanError(f"--gpus: {cards} cards but the model has only {num_layers} layers")
    return list(itertools.combinations(range(1, num_layers), max(cards - 1, 0)))


def even_split(num_layers: int, cards: int) -> tuple[int, ...]:
    return tuple(round(num_layers * i / cards) for i in range(1, cards))


def best_plan(mb: ModelBytes, prof: HardwareProfile, req, pop: Popularity | None = None,
              model: str = "", experts_path: str | None = None) -> Plan:
    """The most even split among those that fit and whose predicted tok/s is within TIE of the best
    (the model is not finer than that: two identical cards calibrate a few % apart, which alone would
    pile the layers on one of them), the faster of equally even ones."""
    from hybrid.planner.build import card_caps, make_plan

    card_caps(prof, req)              # errors about --gpus / --vram-cap come before any split
    L, n = mb.config.num_hidden_layers, len(req.gpus)
    fits = []
    for split in candidate_splits(L, n):
        try:
            fits.append(make_plan(mb, prof, replace(req, layer_split=split), pop, model, experts_path))
        except PlanError:
            continue
    best = None
    if fits:
        top = max(p.prediction.tok_s for p in fits)
        near = [p for p in fits if p.prediction.tok_s >= top * (1 - TIE)]
        best = min(near, key=lambda p: (_imbalance(p), -p.prediction.tok_s))
    if best is None:
        even = even_split(L, n)
        try:
            make_plan(mb, prof, replace(req, layer_split=even), pop, model, experts_path)
        except PlanError as exc:
            raise PlanError(f"no layer split fits; at the even split {','.join(map(str, even)) or '-'}: {exc}") from None
    return best


def _imbalance(plan: Plan) -> int:
    sizes = [b - a for a, b in (c.layers for c in plan.cards)]
    return max(sizes, default=0) - min(sizes, default=0)

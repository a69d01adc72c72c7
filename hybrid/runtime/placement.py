"""Placement: which layers each logical card runs and how many expert-cache slots each layer gets.

Made from a planner Plan (when a hardware profile is known) or, in CPU mode without one, from the
flags alone: --layer-split auto = an even split, --cache-slots auto = half of each card's experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.errors import PlanError


@dataclass(frozen=True)
class CardSpec:
    """One logical card. layers = [start, stop); slots_per_layer in layer order."""

    card: int
    device: str               # torch device string: "cuda:0", "cpu"
    gpu: int                  # CUDA ordinal (or profile GPU index in CPU mode)
    layers: tuple[int, int]
    slots_per_layer: tuple[int, ...]

    def __post_init__(self) -> None:
        a, b = self.layers
        if not 0 <= a < b or len(self.slots_per_layer) != b - a or min(self.slots_per_layer) < 0:
            raise PlanError(f"card {self.card}: bad placement layers {self.layers} "
                            f"slots {self.slots_per_layer}")

    @property
    def layer_ids(self) -> range:
        return range(*self.layers)

    @property
    def slots(self) -> int:
        return sum(self.slots_per_layer)


@dataclass(frozen=True)
class Placement:
    cards: tuple[CardSpec, ...]
    num_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        covered = [l for c in self.cards for l in c.layer_ids]
        if covered != list(range(self.num_layers)):
            raise PlanError(f"placement: cards must cover layers 0..{self.num_layers - 1} in order, "
                            f"got {[c.layers for c in self.cards]}")

    def card_of(self, layer: int) -> CardSpec:
        for c in self.cards:
            if c.layers[0] <= layer < c.layers[1]:
                return c
        raise ValueError(f"layer {layer} is on no card")

    def layer_devices(self) -> list[torch.device]:
        return [torch.device(self.card_of(l).device) for l in range(self.num_layers)]

    def describe(self) -> str:
        return " | ".join(f"card {c.card} ({c.device}): layers {c.layers[0]}-{c.layers[1] - 1}, "
                          f"{c.slots}/{(c.layers[1] - c.layers[0]) * self.num_experts} expert slots"
                          for c in self.cards)

    @classmethod
    def from_plan(cls, plan, device: str, num_experts: int) -> "Placement":
        """Cards from a planner Plan; device 'cuda' maps each card to cuda:<its GPU>."""
        cards = tuple(CardSpec(c.card, _dev(device, c.device), c.device, tuple(c.layers),
                               tuple(c.slots_per_layer)) for c in plan.cards)
        return cls(cards, plan.cards[-1].layers[1], num_experts)

    @classmethod
    def manual(cls, num_layers: int, num_experts: int, gpus: tuple[int, ...], device: str,
               layer_split: tuple[int, ...] | None, cache_slots: tuple[int, ...] | None) -> "Placement":
        """Without a planner: even split for auto, half the experts per card for auto slots."""
        n = len(gpus)
        split = layer_split if layer_split is not None else tuple(
            round(num_layers * i / n) for i in range(1, n))
        bounds = (0, *split, num_layers)
        if any(b >= a for b, a in zip(bounds, bounds[1:])):
            raise PlanError(f"--layer-split {','.join(map(str, split))}: boundaries must increase "
                            f"strictly within 1..{num_layers - 1} so each card holds a layer")
        cards = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            total = (b - a) * num_experts
            want = total // 2 if cache_slots is None else cache_slots[i if len(cache_slots) > 1 else 0]
            cards.append(CardSpec(i, _dev(device, gpus[i]), gpus[i], (a, b),
                                  spread(min(want, total), b - a)))
        return cls(tuple(cards), num_layers, num_experts)


def spread(slots: int, layers: int) -> tuple[int, ...]:
    """Slots over layers as evenly as possible, the first layers taking the remainder."""
    return tuple(slots // layers + (i < slots % layers) for i in range(layers))


def _dev(device: str, gpu: int) -> str:
    return f"cuda:{gpu}" if device == "cuda" else "cpu"

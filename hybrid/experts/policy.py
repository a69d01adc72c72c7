"""Expert-cache policies behind one small interface; the ExpertCache owns slots, a policy only decides.

Per layer, the cache calls, in this order within a decode step:
    touch(layer, used, step)        the unique experts routed this step (hits and misses), sorted
    rank(layer, misses)             the order in which missed experts are considered for promotion
    victim(layer, candidates)       which evictable resident to drop (candidates never include
                                    experts the layer uses this step)
    admit(layer, expert, victim)    promote `expert` into a free slot (victim None) or over `victim`?
Every choice breaks ties by expert id, so a policy is a deterministic function of what it saw:
the runtime and an offline replay of its trace make the same decisions.

Policies:
- "lfu-decay" (default, "ours"): score_e(t) = sum over uses s <= t of g^(t-s), g = 0.5^(1/half_life)
  (each step a layer is looked up, all of its scores are multiplied by g, then +1 for each expert
  used). A missed expert e is promoted into a free slot, or over the weakest evictable resident v
  (lowest score) only when score_e > score_v + margin. The margin is hysteresis: after e displaces
  v, v can only come back once their score difference has moved by 2*margin, and that difference
  moves by at most 2 per step, so a pair swaps at most once every `margin` steps. margin=0 is
  plain decayed LFU; half_life=inf gives undecayed counts (classic LFU). Defaults: OURS below.
- "lru": evict the least recently used resident; always promote a miss.
- "static": a fixed set per layer, the top-`slots` experts of an expert-popularity profile; only
  members are promoted (into free slots or over non-members), members are never evicted. With a
  warm start from the same profile it never promotes at all.
- "belady": offline optimum for the hit rate (needs the future requests): evict the resident whose
  next use is farthest, promote a miss only if its next use is nearer than the victim's (bypass
  otherwise), warm start with the experts used first; ties on the next use are broken by the
  uses after it. Upper bound for every policy run under the
  cache's rules (promote only what was just routed, never evict what the layer uses this step).
"""
from __future__ import annotations

import bisect
import math
from typing import Mapping, Sequence

import numpy as np

from hybrid.errors import HybridError
from hybrid.experts.popularity import ExpertProfile

DEFAULT_POLICY = "lfu-decay"
# The runtime's default "lfu-decay" parameters. Chosen on synthetic Zipf traces with drifting
# popularity (8 layers x 128 experts, top-8, 16-32 slots, half-life 16-128 x margin 0-4): within
# 2.5 points of the sweep's best hit rate on every trace, at < 2 promotions per step. Re-tune on
# real traces with `hybrid-bench cache --half-life H --margin M`.
OURS = {"half_life": 32.0, "margin": 1.0}
NEVER = math.inf


class PolicyError(HybridError):
    """Unknown cache policy or missing input for one (e.g. static without a profile)."""


class CachePolicy:
    """Base class: per-layer state, decisions only (call order: see the module docstring)."""

    name = "?"

    def params(self) -> dict:
        return {}

    def spec(self) -> dict:
        """{"name": ..., **params}: enough for make_policy to rebuild it (traces store this)."""
        return {"name": self.name, **self.params()}

    def attach(self, layer: int, capacity: int, num_experts: int) -> None:
        """Called once per layer by the cache before any other call."""

    def seed(self, layer: int, probs: np.ndarray) -> None:
        """Warm start hint: P(token uses expert e) for the layer, float [E]. Default: ignored."""

    def touch(self, layer: int, used: Sequence[int], step: int) -> None:
        raise NotImplementedError

    def touch_many(self, layers: Sequence[int], used: Sequence[Sequence[int]], step: int,
                   pairs: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """touch(layers[j], used[j], step) for each j, in order (policies may batch it; pairs: the
        same as (index into layers, expert) arrays, for those that want them)."""
        for layer, u in zip(layers, used):
            self.touch(layer, u, step)

    def rank(self, layer: int, misses: Sequence[int]) -> list[int]:
        return sorted(misses)

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        raise NotImplementedError

    def admit(self, layer: int, expert: int, victim: int | None) -> bool:
        return True


class DecayedLFU(CachePolicy):
    """Frequency with exponential decay and a promotion margin ("lfu-decay", the default)."""

    name = "lfu-decay"

    def __init__(self, half_life: float = OURS["half_life"], margin: float = OURS["margin"]):
        if not half_life > 0 or margin < 0:
            raise PolicyError(f"lfu-decay: need half_life > 0 and margin >= 0, got {half_life}, {margin}")
        self.half_life, self.margin = float(half_life), float(margin)
        self.gamma = 1.0 if math.isinf(self.half_life) else 0.5 ** (1.0 / self.half_life)
        self.scores: dict[int, np.ndarray] = {}   # layer -> float64 [E], a row (view) of _mat
        self.last: dict[int, int] = {}            # layer -> step of its last decay
        self._mat = np.zeros((0, 0))              # [attached layers, E]: every layer's scores
        self._rowof: dict[int, int] = {}          # layer -> its row of _mat

    def params(self) -> dict:
        return {"half_life": self.half_life, "margin": self.margin}

    def attach(self, layer: int, capacity: int, num_experts: int) -> None:
        if self._rowof and num_experts != self._mat.shape[1]:
            raise PolicyError(f"lfu-decay: layer {layer} has {num_experts} experts, others {self._mat.shape[1]}")
        if layer not in self._rowof:
            self._rowof[layer] = len(self._rowof)
            self._mat = np.concatenate([self._mat.reshape(-1, num_experts), np.zeros((1, num_experts))])
            self.scores = {l: self._mat[r] for l, r in self._rowof.items()}     # views of the new _mat
        self.scores[layer][:] = 0.0
        self.last[layer] = 0

    def seed(self, layer: int, probs: np.ndarray) -> None:
        """Steady state of the decayed score of an expert used with probability p: p / (1 - g)."""
        scale = 1.0 / (1.0 - self.gamma) if self.gamma < 1.0 else 1.0
        self.scores[layer][:] = np.asarray(probs, dtype=np.float64) * scale

    def touch(self, layer: int, used: Sequence[int], step: int) -> None:
        s = self.scores[layer]
        for _ in range(step - self.last[layer]):   # repeated multiply: bit-identical everywhere
            s *= self.gamma
        self.last[layer] = max(step, self.last[layer])
        s[list(used)] += 1.0

    def touch_many(self, layers: Sequence[int], used: Sequence[Sequence[int]], step: int,
                   pairs: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """The same float operations as touch() per layer (each row decayed by repeated multiplies,
        then +1 per used expert) on all the layers' rows at once. used[j]: unique ids of layers[j];
        pairs: the same as (index into layers, expert) int arrays, if the caller has them."""
        if len(set(layers)) != len(layers):
            return super().touch_many(layers, used, step, pairs)
        rows = np.fromiter((self._rowof[l] for l in layers), dtype=np.int64, count=len(layers))
        gaps = [step - self.last[l] for l in layers]
        whole = len(rows) == len(self._mat) and bool((rows == np.arange(len(rows))).all())
        for g in range(max(gaps, default=0)):
            if whole and min(gaps) > g:
                self._mat *= self.gamma                                          # in place, all rows
            else:
                sel = rows[np.asarray(gaps) > g]
                self._mat[sel] *= self.gamma
        if pairs is None:
            j = np.repeat(np.arange(len(layers)), [len(u) for u in used])
            e = np.fromiter((x for u in used for x in u), dtype=np.int64, count=len(j))
        else:
            j, e = pairs
        self._mat[rows[j], e] += 1.0
        for l in layers:
            self.last[l] = max(step, self.last[l])

    def score(self, layer: int, expert: int) -> float:
        return float(self.scores[layer][expert])

    def rank(self, layer: int, misses: Sequence[int]) -> list[int]:
        s = self.scores[layer].tolist()
        return sorted(misses, key=lambda e: (-s[e], e))

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        s = self.scores[layer].tolist()
        return min(candidates, key=lambda e: (s[e], e))

    def admit(self, layer: int, expert: int, victim: int | None) -> bool:
        if victim is None:
            return True
        s = self.scores[layer]
        return bool(s[expert] > s[victim] + self.margin)


class LRU(CachePolicy):
    """Least recently used ("lru")."""

    name = "lru"

    def __init__(self):
        self.last_use: dict[int, np.ndarray] = {}   # layer -> int64 [E], -1 = never

    def attach(self, layer: int, capacity: int, num_experts: int) -> None:
        self.last_use[layer] = np.full(num_experts, -1, dtype=np.int64)

    def touch(self, layer: int, used: Sequence[int], step: int) -> None:
        self.last_use[layer][list(used)] = step

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        t = self.last_use[layer].tolist()
        return min(candidates, key=lambda e: (t[e], e))


class StaticPolicy(CachePolicy):
    """A fixed set per layer: the top-capacity experts of a popularity profile ("static")."""

    name = "static"

    def __init__(self, profile: ExpertProfile):
        self.profile = profile
        self.fixed: dict[int, set[int]] = {}

    def attach(self, layer: int, capacity: int, num_experts: int) -> None:
        if layer >= self.profile.num_layers or num_experts != self.profile.num_experts:
            raise PolicyError(f"static: profile {self.profile.model!r} has {self.profile.num_layers} "
                              f"layers x {self.profile.num_experts} experts; cache wants layer "
                              f"{layer} of {num_experts} experts")
        self.fixed[layer] = set(self.profile.top(layer, capacity))

    def touch(self, layer: int, used: Sequence[int], step: int) -> None:
        pass

    def rank(self, layer: int, misses: Sequence[int]) -> list[int]:
        c = self.profile.counts[layer].tolist()
        return sorted(misses, key=lambda e: (-c[e], e))

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        fixed = self.fixed[layer]
        return min(candidates, key=lambda e: (e in fixed, e))

    def admit(self, layer: int, expert: int, victim: int | None) -> bool:
        fixed = self.fixed[layer]
        return expert in fixed and (victim is None or victim not in fixed)


class _Future:
    """The steps at which one expert is used after `now`, compared lexicographically: the sooner
    next use is smaller; on a tie the sooner use after that, and so on (no more uses = never)."""

    __slots__ = ("steps", "i")

    def __init__(self, steps: Sequence[int], now: int):
        self.steps, self.i = steps, bisect.bisect_right(steps, now)

    @property
    def next(self) -> float:
        return self.steps[self.i] if self.i < len(self.steps) else NEVER

    def _cmp(self, other: "_Future") -> int:
        a, b, i, j = self.steps, other.steps, self.i, other.i
        while True:
            x = a[i] if i < len(a) else NEVER
            y = b[j] if j < len(b) else NEVER
            if x != y:
                return -1 if x < y else 1
            if x == NEVER:
                return 0
            i, j = i + 1, j + 1

    def __lt__(self, other: "_Future") -> bool:
        return self._cmp(other) < 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Future) and self._cmp(other) == 0


class Belady(CachePolicy):
    """Offline optimum: farthest future out, bypass when the miss is needed later than the victim.

    "Farther" compares the next use and, on a tie, the uses after it: several experts of a layer
    are routed in the same step and the one the cache holds then cannot be evicted in that step,
    so which of two tied experts is held decides what survives the step.
    requests: layer -> per step (cache step 0, 1, ...) the ids routed at that step (any shape).
    """

    name = "belady"

    def __init__(self, requests: Mapping[int, Sequence[Sequence[int]]]):
        self.uses: dict[int, dict[int, list[int]]] = {}   # layer -> expert -> sorted steps
        for layer, steps in requests.items():
            per: dict[int, list[int]] = {}
            for t, ids in enumerate(steps):
                for e in np.unique(np.asarray(ids, dtype=np.int64)).tolist():
                    per.setdefault(e, []).append(t)
            self.uses[layer] = per
        self.now: dict[int, int] = {}

    def attach(self, layer: int, capacity: int, num_experts: int) -> None:
        self.uses.setdefault(layer, {})
        self.now[layer] = -1

    def future(self, layer: int, expert: int) -> _Future:
        return _Future(self.uses[layer].get(expert, ()), self.now[layer])

    def next_use(self, layer: int, expert: int) -> float:
        return self.future(layer, expert).next

    def initial(self, layer: int, capacity: int) -> list[int]:
        """Best warm start: the `capacity` experts with the nearest futures (never-used ones excluded)."""
        self.now[layer] = -1
        used = sorted(self.uses[layer])
        return sorted(used, key=lambda e: (self.future(layer, e), e))[:capacity]

    def touch(self, layer: int, used: Sequence[int], step: int) -> None:
        self.now[layer] = step

    def rank(self, layer: int, misses: Sequence[int]) -> list[int]:
        return sorted(misses, key=lambda e: (self.future(layer, e), e))

    def victim(self, layer: int, candidates: Sequence[int]) -> int:
        return max(candidates, key=lambda e: (self.future(layer, e), e))

    def admit(self, layer: int, expert: int, victim: int | None) -> bool:
        mine = self.future(layer, expert)
        return mine.next < NEVER if victim is None else mine < self.future(layer, victim)


POLICIES = ("lfu-decay", "lru", "static", "belady")


def make_policy(spec: str | Mapping, profile: ExpertProfile | None = None,
                requests: Mapping[int, Sequence[Sequence[int]]] | None = None) -> CachePolicy:
    """Build a policy from a name or a spec dict ({"name": ..., **params}, as CachePolicy.spec())."""
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", DEFAULT_POLICY)
    if name == "lfu-decay":
        unknown = set(spec) - {"half_life", "margin"}
        if unknown:
            raise PolicyError(f"lfu-decay: unknown parameter(s) {', '.join(sorted(unknown))}")
        return DecayedLFU(**{k: float(v) for k, v in spec.items()})
    if name == "lru":
        return LRU()
    if name == "static":
        if profile is None:
            raise PolicyError("cache policy 'static' needs an expert-popularity profile (--profile)")
        return StaticPolicy(profile)
    if name == "belady":
        if requests is None:
            raise PolicyError("cache policy 'belady' needs the future requests (offline replay only)")
        return Belady(requests)
    raise PolicyError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")

"""ExpertCache: which routed experts of a card's layers sit in its VRAM slots (bookkeeping only).

The cache maps (layer, expert) -> slot id; the runtime owns the slot storage and copies the
weights when told to. Slot ids are card-global: the i-th layer of `layers` owns the contiguous
block `slot_range(layer)`, so one [S, ...] tensor per card can hold every slot.

One decode step, as the runtime drives it (an offline replay drives the very same calls):

    cache.begin_step()                       # new step: fresh PCIe budget, clock + 1
    for layer in card_layers:                # in layer order
        lk = cache.lookup(layer, ids)        # ids [T, k] -> lk.slots [T, k] (-1 = miss), counters
        ... hits on the GPU (lk.slots), misses on the CPU (lk.misses) ...
        for p in cache.promote_misses(layer, lk):   # policy + budget decide; table already updated
            copy expert p.expert of p.layer into slot p.slot (p.evicted was there)

Counting: one request = one expert of one layer in one lookup, however many of the step's tokens
route to it (that is what costs bytes); hits + misses == requests. Rules every policy obeys:
only an expert the layer just missed can be promoted, an expert the layer uses in this step is
never evicted (so the grouped kernel's slots and the promotions of the same layer never collide),
and promotions of a step cost bytes_per_expert each, at most budget_bytes per step in all. The
budget is spent in layer order, so a cold cache under a tight budget fills its front layers first.
ids are host integers (numpy or CPU tensors), after the one device-to-host copy of the router ids.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from hybrid.errors import HybridError
from hybrid.experts.policy import CachePolicy, make_policy
from hybrid.experts.popularity import ExpertProfile


class CacheError(HybridError):
    """An expert-cache configuration that cannot work (slots, layers, budget)."""


def pcie_budget_bytes(pcie_frac: float, link_bytes_per_s: float, step_s: float) -> int:
    """Promotion bytes allowed per step: --pcie-frac x link bandwidth x step time."""
    if not 0.0 <= pcie_frac <= 1.0:
        raise CacheError(f"--pcie-frac must be in [0, 1], got {pcie_frac}")
    return int(pcie_frac * link_bytes_per_s * step_s)


class Lookup(NamedTuple):
    """One layer's routed ids split by residency. slots: int64 like ids, -1 where missed."""

    layer: int
    slots: np.ndarray
    hits: tuple[int, ...]     # unique resident experts, ascending
    misses: tuple[int, ...]   # unique missing experts, ascending
    hit_slots: tuple[int, ...]   # slot of each of `hits`


class Promotion(NamedTuple):
    layer: int
    expert: int
    slot: int
    evicted: int | None   # expert that held the slot, None if it was free


@dataclass
class CacheStats:
    """Counters per (layer, expert): int64 [nL, E], rows in the order of `layers`."""

    layers: list[int]
    hits: np.ndarray
    misses: np.ndarray
    promotions: np.ndarray
    evictions: np.ndarray
    steps: int
    bytes_promoted: int
    max_step_bytes: int

    def hit_rate(self, layer: int | None = None) -> float:
        """Hits / requests for one layer, or over all layers (0.0 when nothing was requested)."""
        rows = slice(None) if layer is None else self.layers.index(layer)
        h, m = int(self.hits[rows].sum()), int(self.misses[rows].sum())
        return h / (h + m) if h + m else 0.0

    def per_layer(self) -> list[dict]:
        return [{"layer": l, "hits": int(self.hits[i].sum()), "misses": int(self.misses[i].sum()),
                 "promotions": int(self.promotions[i].sum()), "evictions": int(self.evictions[i].sum()),
                 "hit_rate": self.hit_rate(l)} for i, l in enumerate(self.layers)]

    def to_dict(self) -> dict:
        return {"steps": self.steps, "hit_rate": self.hit_rate(), "bytes_promoted": self.bytes_promoted,
                "max_step_bytes": self.max_step_bytes, "layers": self.per_layer()}


class ExpertCache:
    """Slot table + counters + promotion decisions for the layers one card holds.

    layers: the card's layer ids; slots: slots per layer (int, or one int per layer);
    num_experts: E; policy: a CachePolicy (default lfu-decay); bytes_per_expert: bytes one
    promotion moves over PCIe; budget_bytes: promotion bytes per step (None = unbounded).
    """

    def __init__(self, layers: Sequence[int], slots: int | Sequence[int], num_experts: int,
                 policy: CachePolicy | None = None, bytes_per_expert: int = 0,
                 budget_bytes: int | None = None):
        self.layers = [int(l) for l in layers]
        caps = [int(slots)] * len(self.layers) if np.isscalar(slots) else [int(s) for s in slots]
        self._check(caps, num_experts, bytes_per_expert, budget_bytes)
        self.capacities, self.num_experts = caps, int(num_experts)
        self.policy = policy if policy is not None else make_policy("lfu-decay")
        self.bytes_per_expert, self.budget_bytes = int(bytes_per_expert), budget_bytes
        self._row = {l: i for i, l in enumerate(self.layers)}
        self._base = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        nl, e = len(self.layers), self.num_experts
        self.table = np.full((nl, e), -1, dtype=np.int64)              # [nL, E] expert -> slot
        self.owner = np.full(int(self._base[-1]), -1, dtype=np.int64)  # [S] slot -> expert
        self._res: list[dict[int, int]] = [{} for _ in range(nl)]     # per row: expert -> slot
        self._free = [list(self.slot_range(l)) for l in self.layers]   # per row: heap of free slots
        self.hits, self.misses, self.promotions, self.evictions = (
            np.zeros((nl, e), dtype=np.int64) for _ in range(4))
        self.step, self.bytes_promoted, self.max_step_bytes = -1, 0, 0
        self._left, self._step_bytes, self._used = float("inf"), 0, {}
        self.profile: ExpertProfile | None = getattr(self.policy, "profile", None)
        self.seeded = False
        self.warm: dict[int, list[int]] = {}
        for l, cap in zip(self.layers, caps):
            self.policy.attach(l, cap, e)

    def _check(self, caps, num_experts, bytes_per_expert, budget_bytes) -> None:
        if len(set(self.layers)) != len(self.layers) or len(caps) != len(self.layers):
            raise CacheError(f"expert cache: layers {self.layers} must be distinct, one slot count each")
        if any(not 0 <= c <= num_experts for c in caps):
            raise CacheError(f"expert cache: slots per layer must be in 0..{num_experts}, got {caps}")
        if budget_bytes is not None and (budget_bytes < 0 or bytes_per_expert <= 0):
            raise CacheError("expert cache: a PCIe budget needs budget_bytes >= 0 and bytes_per_expert > 0")

    @classmethod
    def from_description(cls, d: Mapping, policy: CachePolicy | None = None) -> "ExpertCache":
        """Rebuild a cache as describe() saw it at start; policy overrides d["policy"]."""
        try:
            profile = ExpertProfile.from_dict(d["profile"]) if d.get("profile") else None
            if policy is None:
                policy = make_policy(d["policy"], profile=profile)
            cache = cls(d["layers"], d["slots"], d["num_experts"], policy,
                        d.get("bytes_per_expert", 0), d.get("budget_bytes"))
        except (KeyError, TypeError) as exc:
            raise CacheError(f"expert cache description: bad or missing field ({exc})") from None
        if d.get("seeded") and profile is not None:
            cache.seed(profile)
        cache.warm_start({int(l): v for l, v in d.get("warm", {}).items()})
        return cache

    # ---- slot table -------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.owner)

    def slot_range(self, layer: int) -> range:
        i = self._row_of(layer)
        return range(int(self._base[i]), int(self._base[i + 1]))

    def slot_table(self, layer: int) -> np.ndarray:
        """expert -> slot for one layer, int64 [E], -1 where not resident (a copy)."""
        return self.table[self._row_of(layer)].copy()

    def slot_of(self, layer: int, expert: int) -> int | None:
        s = int(self.table[self._row_of(layer), expert])
        return None if s < 0 else s

    def residents(self, layer: int) -> dict[int, int]:
        """expert -> slot of one layer's resident experts, by slot."""
        res = self._res[self._row_of(layer)]
        return dict(sorted(res.items(), key=lambda kv: kv[1]))

    def _row_of(self, layer: int) -> int:
        try:
            return self._row[layer]
        except KeyError:
            raise ValueError(f"layer {layer} is not on this card (layers {self.layers})") from None

    # ---- a step -----------------------------------------------------------------------
    def begin_step(self, budget_bytes: int | None = None) -> int:
        """Start a step (one forward pass); budget_bytes overrides the default for this step."""
        self.step += 1
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        if budget is not None and self.bytes_per_expert <= 0:
            raise CacheError("expert cache: a PCIe budget needs bytes_per_expert > 0")
        self._left = float("inf") if budget is None else float(budget)
        self._step_bytes, self._used = 0, {}
        return self.step

    def lookup(self, layer: int, ids) -> Lookup:
        """Split routed ids (int [T, k] or [k]) into hits and misses; count them; feed the policy."""
        if self.step < 0:
            raise RuntimeError("ExpertCache.lookup before begin_step")
        i = self._row_of(layer)
        ids = np.asarray(ids, dtype=np.int64)
        used = sorted(set(ids.ravel().tolist()))       # [U] ascending
        if used and (used[0] < 0 or used[-1] >= self.num_experts):
            raise ValueError(f"layer {layer}: routed ids outside 0..{self.num_experts - 1}")
        slots = self.table[i][ids]                     # [T, k]
        res, hit_row, miss_row = self._res[i], self.hits[i], self.misses[i]
        hits = tuple(e for e in used if e in res)
        misses = tuple(e for e in used if e not in res)
        for e in hits:
            hit_row[e] += 1
        for e in misses:
            miss_row[e] += 1
        self.policy.touch(layer, used, self.step)
        self._used.setdefault(layer, set()).update(used)
        return Lookup(layer, slots, hits, misses, tuple(res[e] for e in hits))

    def lookup_resident(self, layers: Sequence[int], ids) -> list[int]:
        """lookup(layers[j], ids[j]) for each j in order, for layers whose routed experts must all be
        resident (a fully resident layer, whose lookups the runtime defers to the step's end): the
        counters and the policy end as those lookups leave them, in a few numpy calls instead of a
        few per layer. ids [n, T, k] (or [n, k]). -> the unique hit experts per layer; raises if
        any routed expert is not resident (nothing is counted then)."""
        self._check_resident_call(layers, "lookup_resident")
        if not len(layers):
            return []
        ids = np.asarray(ids, dtype=np.int64).reshape(len(layers), -1)                 # [n, T*k]
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"layers {list(layers)}: routed ids outside 0..{self.num_experts - 1}")
        mark = np.zeros((len(layers), self.num_experts), dtype=bool)   # the unique (j, e) pairs by a mark
        mark[np.arange(len(layers))[:, None], ids] = True              # (np.unique took ~25 ms at 48 layers
        return self._settle_used(layers, mark)                         # x 2048 tokens)

    def lookup_used(self, layers: Sequence[int], used) -> list[int]:
        """lookup_resident from each layer's set of routed experts instead of its ids: used [n, E] bool
        (what a prefill step's device can reduce its [n, T, k] ids to before they cross to the host)."""
        self._check_resident_call(layers, "lookup_used")
        return self._settle_used(layers, used)

    def _settle_used(self, layers: Sequence[int], used) -> list[int]:
        used = np.asarray(used, dtype=bool)
        if used.shape != (len(layers), self.num_experts):
            raise ValueError(f"lookup_used: {used.shape} marks for {len(layers)} layers of {self.num_experts} experts")
        rows = np.array([self._row_of(l) for l in layers], dtype=np.int64)            # [n]
        j, e = np.divmod(np.flatnonzero(used), self.num_experts)                      # (j, e) ascending
        r = rows[j]
        missed = self.table[r, e] < 0
        if missed.any():
            bad = int(np.nonzero(missed)[0][0])
            raise RuntimeError(f"layer {layers[j[bad]]}: expert {int(e[bad])} is not resident")
        self.hits[r, e] += 1                                                           # (r, e) unique
        bounds = [0, *np.searchsorted(j, np.arange(1, len(layers))).tolist(), len(e)]
        el = e.tolist()
        out = [el[a:b] for a, b in zip(bounds, bounds[1:])]                            # ascending
        self.policy.touch_many(list(layers), out, self.step, pairs=(j, e))
        for layer, u in zip(layers, out):
            self._used.setdefault(layer, set()).update(u)
        return out

    def _check_resident_call(self, layers: Sequence[int], name: str) -> None:
        if self.step < 0:
            raise RuntimeError(f"ExpertCache.{name} before begin_step")
        if len(set(layers)) != len(layers):
            raise ValueError(f"{name}: layers {list(layers)} must be distinct")

    def promote_misses(self, layer: int, lookup: Lookup) -> list[Promotion]:
        """Promote what the policy admits among lookup.misses, within this step's PCIe budget."""
        done, i, cands = [], self._row_of(layer), None
        if not lookup.misses or not (self._free[i] or self._res[i]):
            return done                                # nothing missed, or a layer with no slots
        for e in self.policy.rank(layer, lookup.misses):
            if not self.affordable():
                break
            if e in self._res[i]:
                continue
            victim = None
            if not self._free[i]:
                cands = self.evictable(layer) if cands is None else cands
                if not cands:
                    break
                victim = self.policy.victim(layer, cands)
            if self.policy.admit(layer, e, victim):
                done.append(self._place(layer, e, victim, charge=True))
                if victim is not None:
                    cands.remove(victim)    # e itself is in use this step: never a candidate
        return done

    def access(self, layer: int, ids) -> tuple[Lookup, list[Promotion]]:
        """lookup then promote_misses: what one layer of a step does to the cache."""
        lk = self.lookup(layer, ids)
        return lk, self.promote_misses(layer, lk)

    def promote(self, layer: int, expert: int) -> tuple[int, int | None]:
        """Force expert into a slot now (free slot first, else the policy's victim): (slot, evicted).

        Charged to this step's budget like any promotion; the runtime copies the weights. A trace
        does not record forced promotions: a run that calls this will not replay exactly.
        """
        if self.slot_of(layer, expert) is not None:
            raise ValueError(f"layer {layer}: expert {expert} is already resident")
        if not self.affordable():
            raise CacheError(f"layer {layer}: the PCIe budget of step {self.step} is spent")
        victim = None
        if not self._free[self._row_of(layer)]:
            cands = self.evictable(layer)
            if not cands:
                raise CacheError(f"layer {layer}: no slot to promote expert {expert} into")
            victim = self.policy.victim(layer, cands)
        p = self._place(layer, expert, victim, charge=True)
        return p.slot, p.evicted

    def affordable(self) -> bool:
        return self._left >= self.bytes_per_expert

    def evictable(self, layer: int) -> list[int]:
        """Residents the layer does not use in this step, ascending."""
        used = self._used.get(layer, set())
        return sorted(e for e in self._res[self._row_of(layer)] if e not in used)

    def _place(self, layer: int, expert: int, victim: int | None, charge: bool) -> Promotion:
        i = self._row_of(layer)
        if victim is None:
            slot = heapq.heappop(self._free[i])             # lowest free slot
        else:
            slot = self._res[i].pop(victim)
            self.table[i, victim] = -1
            self.evictions[i, victim] += int(charge)
        self.table[i, expert], self.owner[slot] = slot, expert
        self._res[i][expert] = slot
        if charge:
            self.promotions[i, expert] += 1
            self._left -= self.bytes_per_expert
            self._step_bytes += self.bytes_per_expert
            self.bytes_promoted += self.bytes_per_expert
            self.max_step_bytes = max(self.max_step_bytes, self._step_bytes)
        return Promotion(layer, int(expert), int(slot), victim)

    # ---- warm start -------------------------------------------------------------------
    def warm_start(self, experts: Mapping[int, Sequence[int]]) -> None:
        """Before the first step: fill free slots in the given order (no PCIe charge, no promotion)."""
        self._before_first_step("warm_start")
        for layer, ids in experts.items():
            if layer not in self._row:
                continue
            placed = self.warm.setdefault(layer, [])
            for e in ids:
                if not self._free[self._row[layer]]:
                    break
                if self.slot_of(layer, int(e)) is None:
                    self._place(layer, int(e), None, charge=False)
                    placed.append(int(e))

    def seed(self, profile: ExpertProfile) -> None:
        """Before the first step: give the policy the profile's routing probabilities as its state."""
        self._before_first_step("seed")
        self._check_profile(profile)
        self.profile, self.seeded = profile, True
        for l in self.layers:
            self.policy.seed(l, profile.probs(l))

    def warm_from_profile(self, profile: ExpertProfile) -> None:
        """Seed the policy and fill each layer's slots with its most used experts."""
        self.seed(profile)
        self.warm_start({l: profile.top(l, c) for l, c in zip(self.layers, self.capacities)})

    def _before_first_step(self, what: str) -> None:
        if self.step >= 0:
            raise RuntimeError(f"ExpertCache.{what} after the first step: a replay could not follow it")

    def _check_profile(self, profile: ExpertProfile) -> None:
        if profile.num_experts != self.num_experts or max(self.layers, default=-1) >= profile.num_layers:
            raise CacheError(f"expert profile {profile.model!r} ({profile.num_layers} layers x "
                             f"{profile.num_experts} experts) does not cover layers {self.layers} "
                             f"x {self.num_experts} experts")

    # ---- reporting --------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return CacheStats(list(self.layers), self.hits.copy(), self.misses.copy(),
                          self.promotions.copy(), self.evictions.copy(), self.step + 1,
                          self.bytes_promoted, self.max_step_bytes)

    def describe(self) -> dict:
        """Everything an offline replay needs to rebuild this cache as it started (JSON-able)."""
        return {"layers": self.layers, "slots": self.capacities, "num_experts": self.num_experts,
                "policy": self.policy.spec(), "bytes_per_expert": self.bytes_per_expert,
                "budget_bytes": self.budget_bytes,
                "warm": {str(l): list(v) for l, v in self.warm.items()}, "seeded": self.seeded,
                "profile": None if self.profile is None else self.profile.to_dict()}

"""Routing traces (JSONL): per step, per layer, the routed expert ids, plus what the runtime measured.

Schema, version 1. One JSON object per line; the first line is the header:

    {"type": "header", "version": 1, "model": str, "num_layers": L, "num_experts": E, "top_k": k,
     "cards": [ExpertCache.describe(), ...],   # caches as they started; [] = routing only
     "meta": {...}}                            # free-form: command, git sha, machine, flags

then one line per step (a forward pass: a decode step, a verify round or a prefill chunk), in order:

    {"type": "step", "step": i,               # 0, 1, 2, ... (consecutive)
     "phase": "decode" | "prefill",
     "ids": [[[k ints] per token] per layer],  # [L, T, k] routed expert ids, layer 0 first
     "weights": [L, T, k] floats | null,       # router weights after top-k (optional)
     "budget_bytes": [per card int|null] | null,  # the PCIe budget each card was given this step,
                                               #   when it differs from the card's default
     "hits": [L ints] | null,                  # the runtime's cache hits per layer this step
     "promotions": [L ints] | null,            # the runtime's promotions per layer this step
     "timings": {name: number}}                # what the runtime measured, e.g. step_ms,
                                               #   gpu_expert_ms, cpu_expert_ms, pcie_bytes

`hits` counts unique experts per layer (as ExpertCache does), so an offline replay can be checked
step by step against the run. A reader accepts fields it does not know.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

from hybrid.errors import HybridError
from hybrid.experts.popularity import ExpertProfile

VERSION = 1
PHASES = ("decode", "prefill")


class TraceError(HybridError):
    """A routing trace file is missing or malformed."""


@dataclass
class TraceHeader:
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    cards: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_experts, self.top_k) < 1 or self.top_k > self.num_experts:
            raise TraceError(f"trace header: need num_layers, num_experts >= 1 and 1 <= top_k <= "
                             f"num_experts, got {self.num_layers}, {self.num_experts}, {self.top_k}")

    def to_dict(self) -> dict:
        return {"type": "header", "version": VERSION, "model": self.model,
                "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "cards": self.cards, "meta": self.meta}


@dataclass
class StepRecord:
    """One step. ids: int64 [L, T, k]; weights: float32 [L, T, k] or None."""

    step: int
    ids: np.ndarray
    weights: np.ndarray | None = None
    phase: str = "decode"
    budget_bytes: list | None = None
    hits: list | None = None
    promotions: list | None = None
    timings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64)
        if self.ids.ndim == 2:                         # [L, k]: one token
            self.ids = self.ids[:, None, :]
        if self.weights is not None:
            self.weights = np.asarray(self.weights, dtype=np.float32).reshape(self.ids.shape)
        if self.ids.ndim != 3 or self.phase not in PHASES:
            raise TraceError(f"trace step {self.step}: ids must be [L, T, k] and phase one of {PHASES}")

    def to_dict(self) -> dict:
        d = {"type": "step", "step": self.step, "phase": self.phase, "ids": self.ids.tolist(),
             "weights": None if self.weights is None else np.round(self.weights, 5).tolist()}
        for key in ("budget_bytes", "hits", "promotions"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        d["timings"] = self.timings
        return d


@dataclass
class Trace:
    header: TraceHeader
    steps: list[StepRecord]

    def requests(self, layer: int) -> list[np.ndarray]:
        """The ids routed to one layer, per step: a list of int64 [T, k]."""
        return [s.ids[layer] for s in self.steps]

    def to_profile(self) -> ExpertProfile:
        """Routing counts of the whole trace as an expert-popularity profile."""
        h = self.header
        counts = np.zeros((h.num_layers, h.num_experts), dtype=np.int64)
        tokens = 0
        for s in self.steps:
            for l in range(h.num_layers):
                np.add.at(counts[l], s.ids[l].ravel(), 1)
            tokens += s.ids.shape[1]
        return ExpertProfile(h.model, h.num_layers, h.num_experts, h.top_k, tokens, counts)


class TraceWriter:
    """Append steps to a JSONL trace: `with TraceWriter(path, header) as w: w.write(record)`."""

    def __init__(self, path: str | Path | IO[str], header: TraceHeader):
        self.header = header
        self._own = not hasattr(path, "write")
        self._f = open(path, "w") if self._own else path
        self._next = 0
        self._line(header.to_dict())

    def write(self, record: StepRecord) -> None:
        h = self.header
        if record.ids.shape[0] != h.num_layers or record.ids.shape[2] != h.top_k:
            raise ValueError(f"trace step {record.step}: ids shape {record.ids.shape}, "
                             f"expected [{h.num_layers}, T, {h.top_k}]")
        if record.step != self._next:
            raise ValueError(f"trace step {record.step}: expected step {self._next}")
        self._next += 1
        self._line(record.to_dict())

    def step(self, ids, **fields) -> StepRecord:
        """Write the next step from ids [L, T, k] (or a list of per-layer [T, k]); returns it."""
        rec = StepRecord(self._next, np.asarray(ids), **fields)
        self.write(rec)
        return rec

    def _line(self, d: dict) -> None:
        self._f.write(json.dumps(d, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._own:
            self._f.close()
        else:
            self._f.flush()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    try:
        f = open(path)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace ({exc.strerror})") from None
    with f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{n}: not JSON ({exc.msg})") from None


def read_trace(path: str | Path) -> Trace:
    """Read and check a whole trace file."""
    lines = iter_lines(path)
    n, d = next(lines, (1, {}))
    if d.get("type") != "header" or d.get("version") != VERSION:
        raise TraceError(f"{path}:{n}: expected a version-{VERSION} header line first")
    header = _header(d, f"{path}:{n}")
    steps = [_step(d, header, f"{path}:{n}") for n, d in lines if d.get("type") == "step"]
    for i, s in enumerate(steps):
        if s.step != i:
            raise TraceError(f"{path}: step {s.step} found where step {i} was expected")
    return Trace(header, steps)


def _header(d: dict, where: str) -> TraceHeader:
    try:
        return TraceHeader(str(d["model"]), int(d["num_layers"]), int(d["num_experts"]),
                           int(d["top_k"]), list(d.get("cards") or []), dict(d.get("meta") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad header field ({exc})") from None


def _step(d: dict, h: TraceHeader, where: str) -> StepRecord:
    try:
        rec = StepRecord(int(d["step"]), np.asarray(d["ids"], dtype=np.int64), d.get("weights"),
                         d.get("phase", "decode"), d.get("budget_bytes"), d.get("hits"),
                         d.get("promotions"), dict(d.get("timings") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad step record ({exc})") from None
    if rec.ids.shape[0] != h.num_layers or rec.ids.shape[2] != h.top_k:
        raise TraceError(f"{where}: ids shape {list(rec.ids.shape)}, expected "
                         f"[{h.num_layers}, T, {h.top_k}]")
    if rec.ids.size and (rec.ids.min() < 0 or rec.ids.max() >= h.num_experts):
        raise TraceError(f"{where}: expert ids outside 0..{h.num_experts - 1}")
    return rec


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, skew: float = 1.0,
                    drift: float = 0.0, seed: int = 0, model: str = "synthetic") -> Trace:
    """Zipf-like routing for tests and what-ifs: P(expert of rank r) ~ (r+1)^-skew per layer
    (a random rank order per layer), log-popularity random-walking by `drift` per step;
    k distinct experts per token drawn without replacement (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1)            # [L, E]
    base = -skew * np.log1p(ranks)                                               # [L, E]
    walk = np.cumsum(rng.standard_normal((steps, num_layers, num_experts)), 0)   # [S, L, E]
    keys = base + drift * walk + rng.gumbel(size=(steps, num_layers, num_experts))
    ids = np.argsort(-keys, axis=2)[:, :, :top_k]                                # [S, L, k]
    header = TraceHeader(model, num_layers, num_experts, top_k,
                         meta={"synthetic": {"skew": skew, "drift": drift, "seed": seed}})
    return Trace(header, [StepRecord(i, ids[i][:, None, :]) for i in range(steps)])


def write_trace(trace: Trace, path: str | Path) -> Path:
    with TraceWriter(path, trace.header) as w:
        for s in trace.steps:
            w.write(s)
    return Path(path)

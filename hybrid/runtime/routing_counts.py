"""Routing counts of a run, saved as an expert-popularity profile (hybrid-run --save-expert-profile FILE).

RoutingCounter takes the runtime's per-step routing where a trace would (HybridExperts.end_step: ids
[L, T, k] of every layer) and counts every token's experts per layer, so the file is what hybrid-profile
writes for calibration texts (counts [L, E] summing to tokens x k per layer): the next run's warm start and
plan read it (--expert-profile FILE, or profiles/<model folder>.experts.json found on its own). Tee hands a
step to the trace writer and the counter both. Steps a run discards (run ahead past an EOS) never reach
end_step and are not counted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hybrid.errors import HybridError


class RoutingCounter:
    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.tokens, self.top_k = 0, top_k

    def step(self, ids, **_fields) -> None:
        ids = np.asarray(ids, dtype=np.int64)                        # [L, T, k]
        n, e = self.counts.shape
        ids = ids.reshape(n, -1, ids.shape[-1])
        if ids.size and (ids.min() < 0 or ids.max() >= e):
            raise ValueError(f"routed ids outside 0..{e - 1}")
        flat = ids.reshape(n, -1) + (np.arange(n, dtype=np.int64) * e)[:, None]
        self.counts += np.bincount(flat.ravel(), minlength=n * e).reshape(n, e)
        self.tokens += ids.shape[1]

    def close(self) -> None:
        pass


class Tee:
    """Each step to both a trace writer and a counter."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def step(self, ids, **fields) -> None:
        for s in self.sinks:
            s.step(ids, **fields)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def check_writable(path: str | Path) -> Path:
    """--save-expert-profile FILE: its folder must exist (checked before the model loads)."""
    p = Path(path)
    if p.is_dir() or not p.parent.is_dir():
        raise HybridError(f"--save-expert-profile {path}: expected a file in an existing folder")
    return p


def save(counter: RoutingCounter, path: str | Path, model: str, model_type: str, command: str) -> Path | None:
    """Write the counts as an expert-popularity profile (written beside, then renamed: never half a file);
    None when nothing was routed."""
    from hybrid.experts.popularity import profile_file_dict
    from hybrid.files import write_text_atomic

    if counter.tokens == 0:
        return None
    p = check_writable(path)
    d = profile_file_dict(model, model_type, counter.counts, counter.tokens, counter.top_k,
                          {"command": command, "routed_by": "hybrid-run (every prefill and decode token)"})
    return write_text_atomic(p, json.dumps(d) + "\n", "--save-expert-profile")


def command_line() -> str:
    return "hybrid-run " + " ".join(sys.argv[1:])

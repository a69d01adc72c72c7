"""The run's counters between two moments (snapshot / window) and the live view built on them.

`hybrid-run --stats-every N` hands a LiveStats to the HybridModel: every N decode steps it prints one
line for the window just ended (decode tok/s, each card's expert hit rate, CPU expert time and the
time the decode loop waited for it, PCIe bytes, promotions) and, with `--metrics FILE`, rewrites the
metrics file from the whole run so far (hybrid.metrics.write_metrics: written beside, then renamed),
so a Prometheus textfile collector or a dashboard reading FILE follows the run. hybrid-bench decode
measures its window with the same snapshot / window.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np


def snapshot(session) -> dict:
    """The session's cumulative counters, copied."""
    s = session.stats
    return {"hits": [c.hits.copy() for c in session.caches], "misses": [c.misses.copy() for c in session.caches],
            "promotions": [c.promotions.copy() for c in session.caches],
            "gpu": s.gpu_expert_s.copy(), "cpu": s.cpu_expert_s.copy(), "wait": s.cpu_wait_s.copy(),
            "sync": s.route_sync_s.copy(), "pcie": dict(s.pcie)}


def window(session, a: dict, b: dict, steps: int) -> dict:
    """What changed between two snapshots, per decode step where it is a time or a byte count."""
    cards = []
    for i, c in enumerate(session.caches):
        h = b["hits"][i] - a["hits"][i]
        m = b["misses"][i] - a["misses"][i]
        per_layer = [round(float(x), 4) for x in h.sum(1) / np.maximum(h.sum(1) + m.sum(1), 1)]
        cards.append({"card": i, "device": session.placement.cards[i].device,
                      "layers": list(session.placement.cards[i].layers), "slots": c.num_slots,
                      "hit_rate": round(float(h.sum() / max(h.sum() + m.sum(), 1)), 4),
                      "layer_hit_rate": per_layer,
                      "promotions": int((b["promotions"][i] - a["promotions"][i]).sum())})
    per = max(steps, 1)
    return {"cards": cards,
            "gpu_expert_ms_per_token": round(1e3 * float((b["gpu"] - a["gpu"]).sum()) / per, 3),
            "cpu_expert_ms_per_token": round(1e3 * float((b["cpu"] - a["cpu"]).sum()) / per, 3),
            "cpu_wait_ms_per_token": round(1e3 * float((b["wait"] - a["wait"]).sum()) / per, 3),
            "route_sync_ms_per_token": round(1e3 * float((b["sync"] - a["sync"]).sum()) / per, 3),
            "pcie_bytes_per_token": {k: round((b["pcie"][k] - a["pcie"][k]) / per) for k in b["pcie"]}}


class LiveStats:
    """Called by HybridModel.forward after every step (after_step); reports every `every` decode steps."""

    def __init__(self, session, every: int, metrics_path: str | Path | None = None, out=None):
        if every < 1:
            raise ValueError(f"report every {every} tokens: must be >= 1")
        self.session, self.every = session, int(every)
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.out = out if out is not None else sys.stderr
        self.decoded = 0
        self._mark()

    def _mark(self) -> None:
        self._snap, self._t, self._n = snapshot(self.session), time.perf_counter(), self.decoded

    def after_step(self, phase: str) -> None:
        if phase != "decode":
            self._mark()                     # a window holds decode steps only
            return
        self.decoded += 1
        if self.decoded - self._n >= self.every:
            self.report()

    def report(self) -> dict:
        """Print the window since the last report; rewrite the metrics file; start the next window."""
        steps = self.decoded - self._n
        dt = time.perf_counter() - self._t
        w = window(self.session, self._snap, snapshot(self.session), steps)
        w["tokens"], w["decode_tok_s"] = steps, round(steps / dt, 3) if dt > 0 else 0.0
        print(self.line(w), file=self.out, flush=True)
        if self.metrics_path is not None:
            self._write_metrics()
        self._mark()
        return w

    def line(self, w: dict) -> str:
        cards = " | ".join(f"card {c['card']} hit {100 * c['hit_rate']:.1f}%" for c in w["cards"])
        pcie = sum(w["pcie_bytes_per_token"].values())
        promo = sum(c["promotions"] for c in w["cards"])
        return (f"[decode {self.decoded}] {w['decode_tok_s']:.1f} tok/s | {cards} | CPU experts "
                f"{w['cpu_expert_ms_per_token']:.2f} ms/token (waited {w['cpu_wait_ms_per_token']:.2f}) | "
                f"PCIe {pcie / 1e6:.2f} MB/token | {promo} promotions")

    def _write_metrics(self) -> None:
        from hybrid.metrics import write_metrics

        write_metrics(self.metrics_path, self.session.report(self.session.stats.decode_tok_s()))

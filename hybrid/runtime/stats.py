"""What the runtime measured: per-layer expert times, PCIe bytes, step times; the end-of-run report
(hit rates per layer and card, CPU vs GPU expert time, decode tok/s, the planner's prediction beside).

Legend: L layers. Times in seconds internally, ms in reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PCIE_KINDS = ("ids_d2h", "act_d2h", "out_h2d", "promotions", "hops")


@dataclass
class RuntimeStats:
    """Accumulators; per-layer arrays are float64 [L] seconds."""

    num_layers: int
    gpu_expert_s: np.ndarray = None
    cpu_expert_s: np.ndarray = None      # runner: submit -> result ready (wall)
    cpu_wait_s: np.ndarray = None        # time the decode loop blocked in sync()
    route_sync_s: np.ndarray = None      # routed ids (and activations) to the host
    pcie: dict = field(default_factory=lambda: {k: 0 for k in PCIE_KINDS})
    steps: dict = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    step_s: dict = field(default_factory=lambda: {"decode": [], "prefill": []})
    tokens: dict = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    graph_steps: int = 0                 # steps run through CUDA graphs (their expert kernels untimed)

    def __post_init__(self) -> None:
        for name in ("gpu_expert_s", "cpu_expert_s", "cpu_wait_s", "route_sync_s"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.num_layers))

    def add_step(self, phase: str, seconds: float, tokens: int) -> None:
        self.steps[phase] += 1
        self.step_s[phase].append(seconds)
        self.tokens[phase] += tokens

    @property
    def pcie_total(self) -> int:
        return int(sum(self.pcie.values()))

    def decode_tok_s(self) -> float:
        """Decode steps (one token each) over their summed forward time."""
        s = sum(self.step_s["decode"])
        return self.steps["decode"] / s if s > 0 else 0.0

    def to_dict(self, caches=(), plan=None, measured_tok_s: float | None = None) -> dict:
        d = {"steps": dict(self.steps), "tokens": dict(self.tokens),
             "decode_forward_tok_s": round(self.decode_tok_s(), 3),
             "gpu_expert_ms": round(1e3 * float(self.gpu_expert_s.sum()), 3),
             "cpu_expert_ms": round(1e3 * float(self.cpu_expert_s.sum()), 3),
             "cpu_wait_ms": round(1e3 * float(self.cpu_wait_s.sum()), 3),
             "route_sync_ms": round(1e3 * float(self.route_sync_s.sum()), 3),
             "graph_steps": self.graph_steps,
             "pcie_bytes": dict(self.pcie), "pcie_bytes_total": self.pcie_total,
             "cards": [], "layers": []}
        n_tok = max(sum(self.tokens.values()), 1)
        d["pcie_bytes_per_token"] = round(self.pcie_total / n_tok, 1)
        for i, c in enumerate(caches):
            st = c.stats()
            d["cards"].append({"card": i, "layers": [c.layers[0], c.layers[-1] + 1], "slots": c.num_slots,
                               "hit_rate": round(st.hit_rate(), 6), "bytes_promoted": st.bytes_promoted,
                               "promotions": int(st.promotions.sum()), "evictions": int(st.evictions.sum())})
            for row in st.per_layer():
                l = row["layer"]
                d["layers"].append({**row, "card": i, "slots": c.capacities[c.layers.index(l)],
                                    "hit_rate": round(row["hit_rate"], 6),
                                    "gpu_expert_ms": round(1e3 * self.gpu_expert_s[l], 3),
                                    "cpu_expert_ms": round(1e3 * self.cpu_expert_s[l], 3)})
        hits = sum(int(c.hits.sum()) for c in caches)
        reqs = hits + sum(int(c.misses.sum()) for c in caches)
        d["hit_rate"] = round(hits / reqs, 6) if reqs else 0.0
        if measured_tok_s is not None:
            d["decode_tok_s"] = round(measured_tok_s, 3)
        if plan is not None:
            p = plan.prediction
            d["prediction"] = {"tok_s": round(p.tok_s, 3), "hit_rate": round(p.hit_rate, 6),
                               "pcie_bytes_per_token": p.pcie_bytes, "profile": plan.inputs.profile,
                               "layer_hit_rate": [round(x.hit_rate, 6) for x in p.layers]}
            if measured_tok_s:
                d["prediction"]["measured_over_predicted"] = round(measured_tok_s / p.tok_s, 4)
        return d


def summary_lines(d: dict) -> list[str]:
    """The --stats report as text lines (from RuntimeStats.to_dict)."""
    out = ["layer card slots  hits misses  hit%   promo  gpu_ms   cpu_ms"]
    for r in d["layers"]:
        out.append(f"{r['layer']:5d} {r['card']:4d} {r['slots']:5d} {r['hits']:5d} {r['misses']:6d} "
                   f"{100 * r['hit_rate']:5.1f} {r['promotions']:7d} {r['gpu_expert_ms']:8.2f} "
                   f"{r['cpu_expert_ms']:8.2f}")
    for c in d["cards"]:
        out.append(f"card {c['card']}: layers {c['layers'][0]}-{c['layers'][1] - 1}, {c['slots']} slots, "
                   f"hit rate {100 * c['hit_rate']:.1f}%, {c['promotions']} promotions "
                   f"({c['bytes_promoted'] / 2**20:.1f} MiB), {c['evictions']} evictions")
    out.append(f"experts: GPU {d['gpu_expert_ms']:.1f} ms, CPU {d['cpu_expert_ms']:.1f} ms "
               f"(decode loop blocked {d['cpu_wait_ms']:.1f} ms), route sync {d['route_sync_ms']:.1f} ms")
    pc = d["pcie_bytes"]
    out.append(f"PCIe: {d['pcie_bytes_total'] / 2**20:.2f} MiB ({d['pcie_bytes_per_token']:.0f} B/token): "
               + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in pc.items()))
    tok = d.get("decode_tok_s", d["decode_forward_tok_s"])
    line = f"decode: {tok:.2f} tok/s measured, hit rate {100 * d['hit_rate']:.1f}%"
    if "prediction" in d:
        p = d["prediction"]
        line += (f" | planner ({p['profile']}): {p['tok_s']:.2f} tok/s, hit rate {100 * p['hit_rate']:.1f}%"
                 + (f", measured/predicted {p['measured_over_predicted']:.2f}"
                    if "measured_over_predicted" in p else ""))
    out.append(line)
    return out

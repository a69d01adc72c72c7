"""Prometheus text exposition (format 0.0.4) and the dashboard JSON, from a runtime report."""
from __future__ import annotations

import json
import math
from pathlib import Path

from hybrid.metrics.registry import Registry


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) else str(int(v))


def render_prometheus(reg: Registry) -> str:
    """# HELP / # TYPE lines then one `name{labels} value` line per sample."""
    out = []
    for m in reg.metrics.values():
        out.append(f"# HELP {m.name} {m.help}")
        out.append(f"# TYPE {m.name} {m.kind}")
        for labels, v in m.samples.items():
            lab = ",".join(f'{k}="{_escape(val)}"' for k, val in labels)
            out.append(f"{m.name}{{{lab}}} {_num(v)}" if lab else f"{m.name} {_num(v)}")
    return "\n".join(out) + "\n"


def registry_from_report(report: dict) -> Registry:
    """Counters per layer and card, times, PCIe bytes, tok/s (measured and predicted)."""
    r = Registry()
    for key, help in (("hits", "expert-cache hits"), ("misses", "expert-cache misses"),
                      ("promotions", "experts promoted into a slot"), ("evictions", "experts evicted")):
        m = r.counter(f"expert_{key}_total", f"{help}, per layer (unique experts per step)")
        for row in report["layers"]:
            m.inc(row[key], layer=row["layer"], card=row["card"])
    hr = r.gauge("expert_hit_rate", "hits / requests per card")
    for c in report["cards"]:
        hr.set(c["hit_rate"], card=c["card"])
    t = r.counter("expert_seconds_total", "expert compute time by side")
    t.inc(report["gpu_expert_ms"] / 1e3, side="gpu")
    t.inc(report["cpu_expert_ms"] / 1e3, side="cpu")
    r.counter("cpu_wait_seconds_total", "decode loop blocked waiting for the CPU runner").inc(
        report["cpu_wait_ms"] / 1e3)
    p = r.counter("pcie_bytes_total", "bytes moved over PCIe by kind")
    for kind, n in report["pcie_bytes"].items():
        p.inc(n, kind=kind)
    steps = r.counter("steps_total", "forward passes by phase")
    for phase, n in report["steps"].items():
        steps.inc(n, phase=phase)
    tok = r.gauge("decode_tokens_per_second", "decode speed")
    tok.set(report.get("decode_tok_s", report["decode_forward_tok_s"]), source="measured")
    if "prediction" in report:
        tok.set(report["prediction"]["tok_s"], source="planner")
    return r


def dashboard(report: dict) -> dict:
    """What a dashboard plots: per-layer series plus the headline numbers."""
    layers = report["layers"]
    return {"schema": 1, "kind": "hybrid-dashboard",
            "headline": {k: report.get(k) for k in ("decode_tok_s", "decode_forward_tok_s", "hit_rate",
                                                     "pcie_bytes_per_token", "gpu_expert_ms", "cpu_expert_ms")},
            "prediction": report.get("prediction"),
            "series": {"layer": [x["layer"] for x in layers], "card": [x["card"] for x in layers],
                       "hit_rate": [x["hit_rate"] for x in layers],
                       "gpu_expert_ms": [x["gpu_expert_ms"] for x in layers],
                       "cpu_expert_ms": [x["cpu_expert_ms"] for x in layers],
                       "promotions": [x["promotions"] for x in layers]},
            "cards": report["cards"], "pcie_bytes": report["pcie_bytes"]}


def write_metrics(path: str | Path, report: dict) -> Path:
    """FILE.json -> dashboard JSON; anything else -> Prometheus text. Written beside FILE, then
    renamed over it: a reader (a textfile collector, a dashboard) never sees half a file."""
    from hybrid.files import write_text_atomic

    path = Path(path)
    text = (json.dumps(dashboard(report), indent=1) + "\n" if path.suffix == ".json"
            else render_prometheus(registry_from_report(report)))
    return write_text_atomic(path, text, "--metrics")

"""Counters and gauges with labels, the shape Prometheus expects (no client library needed)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
KINDS = ("counter", "gauge")


@dataclass
class Metric:
    name: str
    kind: str
    help: str
    samples: dict = field(default_factory=dict)   # tuple(sorted label items) -> float

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.kind not in KINDS:
            raise ValueError(f"metric {self.name!r}: bad name or kind {self.kind!r}")

    def set(self, value: float, **labels) -> None:
        self.samples[tuple(sorted((k, str(v)) for k, v in labels.items()))] = float(value)

    def inc(self, value: float = 1.0, **labels) -> None:
        if value < 0 and self.kind == "counter":
            raise ValueError(f"counter {self.name}: cannot decrease")
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        self.samples[key] = self.samples.get(key, 0.0) + float(value)


class Registry:
    """Named metrics in registration order."""

    def __init__(self, prefix: str = "hybrid_"):
        self.prefix, self.metrics = prefix, {}

    def metric(self, name: str, kind: str, help: str) -> Metric:
        full = self.prefix + name
        if full not in self.metrics:
            self.metrics[full] = Metric(full, kind, help)
        return self.metrics[full]

    def counter(self, name: str, help: str) -> Metric:
        return self.metric(name, "counter", help)

    def gauge(self, name: str, help: str) -> Metric:
        return self.metric(name, "gauge", help)

"""Run counters as Prometheus text exposition and as the JSON a dashboard reads."""
from hybrid.metrics.exposition import dashboard, registry_from_report, render_prometheus, write_metrics
from hybrid.metrics.registry import Metric, Registry

__all__ = ["Metric", "Registry", "render_prometheus", "registry_from_report", "dashboard", "write_metrics"]

"""InferenceMonitor: application metrics beside the engine's, with a two-method API.

``record_metric(name, value)`` sets a gauge and ``observe(name, value)`` feeds a histogram;
each collector is created on first use under the ``pagedllm:`` prefix (application metrics
are not vLLM's, so they stay out of its ``vllm:`` namespace) and the monitor's labels. Share
the server's registry (``app.state.monitor`` already does) and the metrics appear at /metrics
next to the engine's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.stats import IterationStats, SchedulerStats
from pagedllm.metrics.prometheus import LATENCY_BUCKETS

PREFIX = "pagedllm:"

_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class InferenceMonitor:
    """Gauges, histograms and counters named by user code, created lazily and thread-safe."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        labels: dict[str, str] | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = dict(labels or {})
        self.prefix = prefix
        self._metrics: dict[str, tuple[type, object]] = {}  # name -> (kind, labelled child)
        self._lock = threading.Lock()

    def record_metric(self, name: str, value: float, documentation: str = "") -> None:
        """Set gauge ``name`` to value."""
        self._get(Gauge, name, documentation).set(value)

    def observe(
        self,
        name: str,
        value: float,
        documentation: str = "",
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        """Add one observation to histogram ``name`` (buckets apply on first use)."""
        self._get(Histogram, name, documentation, buckets=tuple(buckets)).observe(value)

    def increment(self, name: str, amount: float = 1.0, documentation: str = "") -> None:
        """Add amount (>= 0) to counter ``name``."""
        self._get(Counter, name, documentation).inc(amount)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _get(self, kind: type, name: str, documentation: str, **kwargs: object) -> object:
        with self._lock:
            known = self._metrics.get(name)
            if known is not None:
                if known[0] is not kind:
                    raise ValueError(
                        f"metric {name!r} is a {known[0].__name__}, not a {kind.__name__}."
                    )
                return known[1]
            if not _NAME.match(name):
                raise ValueError(f"metric name {name!r} must match {_NAME.pattern}.")
            collector = kind(
                self.prefix + name,
                documentation or name.replace("_", " "),
                list(self.labels),
                registry=self.registry,
                **kwargs,
            )
            child = collector.labels(**self.labels) if self.labels else collector
            self._metrics[name] = (kind, child)
            return child


class MonitorStatLogger:
    """Feeds an InferenceMonitor from the engine (a stat logger): ``kv_cache_hit_rate``, the
    share of prompt tokens found in the prefix cache since start, the gauge user code sets
    with ``record_metric`` and dashboards read next to vLLM's counters."""

    def __init__(self, monitor: InferenceMonitor) -> None:
        self.monitor = monitor
        self._set_hit_rate(0.0)  # exported from the start, before any lookup

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        queries = scheduler_stats.prefix_cache_queries
        if queries:
            self._set_hit_rate(scheduler_stats.prefix_cache_hits / queries)

    def _set_hit_rate(self, value: float) -> None:
        self.monitor.record_metric(
            "kv_cache_hit_rate", value, "Share of prompt tokens found in the prefix cache."
        )

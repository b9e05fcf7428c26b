"""Engine metrics: Prometheus collectors, a periodic log line, and InferenceMonitor.

Imported lazily: the log line needs nothing beyond the standard library, the rest needs
prometheus_client (the ``serve`` extra).
"""

from __future__ import annotations

from pagedllm.lazy import lazy_getattr

_EXPORTS = {
    "InferenceMonitor": "pagedllm.metrics.monitor",
    "LoggingStatLogger": "pagedllm.metrics.loggers",
    "PrometheusStatLogger": "pagedllm.metrics.prometheus",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)

"""Engine metrics: Prometheus collectors, a periodic log line, and InferenceMonitor.

Imported lazily: the log line needs nothing beyond the standard library, the rest needs
prometheus_client (the ``serve`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InferenceMonitor": "pagedllm.metrics.monitor",
    "LoggingStatLogger": "pagedllm.metrics.loggers",
    "PrometheusStatLogger": "pagedllm.metrics.prometheus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

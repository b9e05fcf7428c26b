"""Edge/cloud split inference, an optional plugin: device profiles, the model's cost graph,
the partitioner that chooses the cut(s), and the runtime that runs a plan across processes.

Nothing below the entrypoints imports this package; the engine reaches the runtime only
through the executor registry (pagedllm.worker.executor, name "split"). The names below are
imported on first use, so ``import pagedllm.partition`` loads neither torch nor the model.
"""

from __future__ import annotations

from pagedllm.lazy import lazy_getattr

_LAZY = {
    "DeviceProfile": "pagedllm.partition.profiles",
    "LayerTimings": "pagedllm.partition.profiles",
    "LinkProfile": "pagedllm.partition.profiles",
    "GraphPartitioner": "pagedllm.partition.partitioner",
    "PartitionPlan": "pagedllm.partition.plan",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)

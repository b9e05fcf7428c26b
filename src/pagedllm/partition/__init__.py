"""Edge/cloud split inference: device profiles, the model's cost graph, the partitioner
that chooses the cut(s), and the runtime that runs a plan across processes."""

from pagedllm.partition.partitioner import GraphPartitioner
from pagedllm.partition.plan import PartitionPlan
from pagedllm.partition.profiler import DeviceProfile, LayerTimings, LinkProfile

__all__ = ["DeviceProfile", "GraphPartitioner", "LayerTimings", "LinkProfile", "PartitionPlan"]

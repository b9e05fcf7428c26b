"""Runs the model for the engine: in this process, or (tensor parallel) across workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.worker.model_runner import KVCacheSpec, ModelOutput, ModelRunner


class ExecutorLostError(RuntimeError):
    """A remote part of the model (a partition tier) is gone, and with it the KV state of
    every running sequence: the engine fails those requests and starts the rest afresh."""


class Executor(ABC):
    @abstractmethod
    def initialize_cache(self) -> KVCacheSpec:
        """Size the KV cache from the memory budget and allocate it on every worker."""

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelOutput: ...

    @abstractmethod
    def release(self, seq_ids: list[int]) -> None:
        """Forget per-sequence sampler state of finished sequences."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass

    @property
    def load_seconds(self) -> float:
        return 0.0


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def initialize_cache(self) -> KVCacheSpec:
        spec = self.runner.plan_kv_cache()
        self.runner.allocate_kv_cache(spec.num_blocks)
        return spec

    def execute_model(self, out: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(out)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.runner.release(seq_id)

    @property
    def load_seconds(self) -> float:
        return self.runner.load_seconds


def create_executor(config: EngineConfig) -> Executor:
    if config.partition is not None:
        if config.partition.role != "edge":
            raise ValueError("the cloud tier runs as `pagedllm split-worker`, not as an engine.")
        from pagedllm.partition.runtime import SplitExecutor

        return SplitExecutor(config)
    if config.parallel.tensor_parallel_size > 1:
        from pagedllm.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniProcExecutor(config)

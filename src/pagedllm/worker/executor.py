"""Runs the model for the engine: in this process, across tensor-parallel workers, or split
across an edge and a cloud process.

Executors are registered by name, as attention backends are: the registry holds module paths
that are imported only when that executor is chosen, so an optional feature (the edge/cloud
split in ``pagedllm.partition``) is never imported by an engine that does not use it.

The engine <-> worker contract is ``execute_model(SchedulerOutput) -> ModelOutput``: the
scheduler output carries the step's batch and the ids of the sequences that finished since
the last step (whose per-sequence state the workers drop). Every executor failure that
loses the KV state of the running sequences is an ``ExecutorLostError``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache import KVCacheSpec
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.worker.model_runner import ModelOutput, ModelRunner

# name -> "module:Class"; imported lazily by executor_class.
EXECUTORS: dict[str, str] = {
    "uniproc": "pagedllm.worker.executor:UniProcExecutor",
    "multiproc": "pagedllm.worker.multiproc_executor:MultiprocExecutor",
    "split": "pagedllm.partition.runtime:SplitExecutor",
}


class ExecutorLostError(RuntimeError):
    """A part of the model that runs elsewhere (a tensor-parallel rank, a partition tier) is
    gone, and with it the KV state of every running sequence: the engine fails those
    requests and starts the rest afresh."""


class Executor(ABC):
    @abstractmethod
    def initialize_cache(self) -> KVCacheSpec:
        """Size the KV cache from the memory budget and allocate it on every worker."""

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelOutput:
        """Run one step; first drop the state of ``out.finished_seq_ids``."""

    @property
    @abstractmethod
    def local_runner(self) -> ModelRunner:
        """The model runner in this process (rank 0, or the first tier): for tools that time
        or inspect the model, never for running steps outside ``execute_model``."""

    @property
    def pipeline_depth(self) -> int:
        """How many steps may be in flight at once (submit / collect); 1: execute_model."""
        return 1

    def submit(self, out: SchedulerOutput) -> object:
        """Start a step and return a handle for collect (pipeline_depth > 1 only)."""
        return out

    def collect(self, handle: object) -> ModelOutput:
        """Finish the oldest submitted step."""
        assert isinstance(handle, SchedulerOutput)
        return self.execute_model(handle)

    @property
    def repartition_pending(self) -> bool:
        """True when the model's layout across processes should change (a split whose cut
        moved): the engine then drains its steps, preempts its running sequences (their KV
        is laid out for the old layout) and calls repartition()."""
        return False

    def repartition(self) -> None:
        """Carry out the pending layout change (only when repartition_pending)."""
        raise NotImplementedError

    @property
    def is_driver(self) -> bool:
        """False on a process that only serves another process's engine (see run_worker)."""
        return True

    @property
    def dead_error(self) -> ExecutorLostError | None:
        """What ended this executor for good (a tensor-parallel rank died): no later step can
        run, so the engine above it is dead too. None while steps can run."""
        return None

    def run_worker(self) -> None:
        """Serve the driver's steps until it stops (only where ``is_driver`` is False)."""
        raise NotImplementedError

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass

    @property
    def load_seconds(self) -> float:
        return self.local_runner.load_seconds


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner.from_engine_config(config)

    def initialize_cache(self) -> KVCacheSpec:
        spec = self.runner.plan_kv_cache(grouped=True)
        self.runner.allocate_kv_cache(spec.num_blocks, [g.num_blocks for g in spec.extra_groups])
        return spec

    def execute_model(self, out: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(out)

    @property
    def local_runner(self) -> ModelRunner:
        return self.runner


def executor_name(config: EngineConfig) -> str:
    """The registered executor an engine config asks for."""
    if config.partition is not None:
        if config.partition.role != "edge":
            raise ValueError("the cloud tier runs as `pagedllm split-worker`, not as an engine.")
        return "split"
    return "multiproc" if config.parallel.tensor_parallel_size > 1 else "uniproc"


def executor_class(name: str) -> type[Executor]:
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; registered: {sorted(EXECUTORS)}.")
    module, _, cls = EXECUTORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_executor(config: EngineConfig) -> Executor:
    """The executor for config. A process that is not the driver (a tensor-parallel rank
    other than 0 on a worker node, or under a launcher) serves its ranks here and exits
    when the driver shuts down: it never becomes an engine."""
    executor = executor_class(executor_name(config))(config)
    if not executor.is_driver:
        executor.run_worker()
        raise SystemExit(0)
    return executor

"""The executor registry: names -> lazily imported classes, one error hierarchy, and a
tensor-parallel executor whose __init__ returns on every rank."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pagedllm.config import EngineArgs, PartitionConfig
from pagedllm.worker.executor import (
    EXECUTORS,
    Executor,
    ExecutorLostError,
    executor_class,
    executor_name,
)


def test_names_follow_the_config(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    assert executor_name(config) == "uniproc"
    tp = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, tensor_parallel_size=2)
    )
    assert executor_name(tp) == "multiproc"
    edge = dataclasses.replace(config, partition=PartitionConfig("p.json", "edge", "h:1"))
    assert executor_name(edge) == "split"
    cloud = dataclasses.replace(config, partition=PartitionConfig("p.json", "cloud", None))
    with pytest.raises(ValueError, match="split-worker"):
        executor_name(cloud)


def test_every_registered_name_is_an_executor():
    for name in EXECUTORS:
        assert issubclass(executor_class(name), Executor)
    with pytest.raises(ValueError, match="unknown executor"):
        executor_class("nope")


def test_a_dead_rank_and_a_lost_peer_are_one_error_kind():
    from pagedllm.worker.multiproc_executor import WorkerDiedError

    assert issubclass(WorkerDiedError, ExecutorLostError)


def test_the_engine_imports_no_partition_code():
    code = (
        "import sys, pagedllm.engine.llm_engine, pagedllm.entrypoints.llm;"
        "print(sorted(m for m in sys.modules if m.startswith('pagedllm.partition')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_partition_package_import_is_lazy():
    code = "import sys, pagedllm.partition as p; p.LinkProfile; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the profiles are torch-free


def test_multiproc_init_returns_on_a_worker_rank(tiny_llama):
    from pagedllm.worker.multiproc_executor import MultiprocExecutor

    args = EngineArgs(
        model=str(tiny_llama),
        device="cpu",
        tensor_parallel_size=2,
        nnodes=2,
        node_rank=1,
        master_port=29999,
    )
    executor = MultiprocExecutor(args.create_engine_config())  # starts nothing on rank 1
    assert not executor.is_driver

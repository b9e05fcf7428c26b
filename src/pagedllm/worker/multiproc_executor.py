"""Tensor-parallel executor: rank 0 runs in the engine's process, the other ranks in workers.

The scheduler runs once, in the engine. Each step rank 0 turns the SchedulerOutput into the
flat batch (``ModelInput``), broadcasts its host arrays to every rank over a gloo control
group, and all ranks run the sharded forward in lockstep (their collectives meet in the
layers). Only rank 0 samples; the others compute the LM head only to join its all-gather.

Processes: on one machine the engine spawns ranks 1..N-1 itself. Over several machines each
node runs the same command with ``--nnodes`` / ``--node-rank`` (or torchrun starts one process
per rank). ``MultiprocExecutor.__init__`` returns on every rank; on a rank other than 0 it is
not a driver, and ``create_executor`` runs its ``run_worker`` loop, which serves until the
engine shuts down and then exits the process, so only rank 0 ever returns an engine.

Workers start with forkserver (its server imports torch and the model code once). A script
that builds the engine at module level, without ``if __name__ == "__main__":``, would be run
again in every such worker; there the workers are forked when that is safe (CUDA not yet
initialised in this process), and otherwise the engine fails at once saying what to write.

A rank that dies closes its sockets, so the next collective on rank 0 fails at once; a rank
that hangs is caught by the collective timeout (PAGEDLLM_TP_TIMEOUT). Either way the step
raises ``WorkerDiedError`` (an ``ExecutorLostError``) naming the rank and its exit code: the
engine ends the running requests with that error, as for a lost partition peer, the other
workers are stopped, and every later step fails alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache import KVCacheSpec
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.communicator import OverlapCommunicator
from pagedllm.distributed.parallel_state import (
    RankPlacement,
    Rendezvous,
    TensorParallelGroups,
    create_store,
    init_tensor_parallel,
    placement,
    rendezvous,
)
from pagedllm.worker.executor import Executor, ExecutorLostError
from pagedllm.worker.model_runner import ModelInput, ModelOutput, ModelRunner
from pagedllm.worker.overlap import forward_overlapped, overlappable, split_batch
from pagedllm.worker.start_method import worker_context

logger = logging.getLogger(__name__)

_JOIN_SECONDS = 10.0  # a worker's grace period to exit after the stop message


class WorkerDiedError(ExecutorLostError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


@dataclass
class StepInput:
    """One step's flat batch as host arrays: what every rank needs to run the forward."""

    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    logits_indices: np.ndarray  # [num_logits]
    metadata: AttentionMetadata  # its tensors as numpy arrays
    overlap: bool  # split into micro-batches whose all-reduces overlap compute
    lora_requests: list[Any] | None = None  # each sequence's adapter (enable_lora)

    @classmethod
    def from_input(cls, inp: ModelInput, overlap: bool) -> StepInput:
        md = inp.metadata.map_tensors(_host)
        host = [_host(t) for t in (inp.input_ids, inp.positions, inp.logits_indices)]
        return cls(*host, md, overlap, inp.lora_requests)

    def to_input(self, device: torch.device) -> ModelInput:
        return ModelInput(
            input_ids=_device(self.input_ids, device),
            positions=_device(self.positions, device),
            metadata=self.metadata.map_tensors(lambda x: _device(x, device)),
            logits_indices=_device(self.logits_indices, device),
            sample_seqs=[],
            sample_rows=[],
            prompt_logprob_rows=[],
            lora_requests=self.lora_requests,
        )


def _host(x: Any) -> Any:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def _device(x: Any, device: torch.device) -> Any:
    return torch.from_numpy(x).to(device) if isinstance(x, np.ndarray) else x


@dataclass
class RpcCall:
    """Run ``fn(runner, *args)`` (or the runner's method of that name) on every rank."""

    fn: str | Callable[..., Any]
    args: tuple[Any, ...]

    def apply(self, runner: ModelRunner) -> Any:
        if isinstance(self.fn, str):
            return getattr(runner, self.fn)(*self.args)
        return self.fn(runner, *self.args)


def _send(group: object, message: StepInput | RpcCall | None) -> None:
    dist.broadcast_object_list([message], src=0, group=group)


def _recv(group: object) -> StepInput | RpcCall | None:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_forward(
    runner: ModelRunner, inp: ModelInput, comm: OverlapCommunicator, overlap: bool
) -> torch.Tensor:
    """The sharded forward, over two interleaved micro-batches when overlap is on."""
    overlap = overlap and runner.lora is None  # LoRA rows index the whole step's tokens
    batches = split_batch(inp.input_ids, inp.positions, inp.metadata) if overlap else None
    if batches is None or comm.world_size == 1 or not overlappable(runner.model):
        return runner.forward(inp)
    with torch.inference_mode():
        return forward_overlapped(runner.model, batches, comm)


def _agree_num_blocks(runner: ModelRunner, comm: OverlapCommunicator) -> KVCacheSpec:
    """Every rank sizes its own cache; all use the smallest count so block ids mean the same."""
    spec = runner.plan_kv_cache(grouped=True)
    counts = [g.num_blocks for g in spec.groups]  # one per KV cache group
    count = torch.tensor(counts, dtype=torch.int64, device=runner.device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=comm.group)
    agreed = [int(c) for c in count.tolist()]
    extra = zip(spec.extra_groups, agreed[1:])
    groups = tuple(dataclasses.replace(g, num_blocks=c) for g, c in extra)
    spec = dataclasses.replace(spec, num_blocks=agreed[0], extra_groups=groups)
    runner.allocate_kv_cache(spec.num_blocks, agreed[1:])
    return spec


def _serve(config: EngineConfig, groups: TensorParallelGroups) -> None:
    """A non-driver rank: load the shard, then run each step rank 0 broadcasts, until stop."""
    runner = ModelRunner.from_engine_config(config, groups.comm)
    _agree_num_blocks(runner, groups.comm)
    while (message := _recv(groups.control)) is not None:
        if isinstance(message, RpcCall):
            dist.gather_object(message.apply(runner), None, dst=0, group=groups.control)
            continue
        inp = message.to_input(runner.device)
        hidden = run_forward(runner, inp, groups.comm, message.overlap)
        if inp.logits_indices.numel():
            with torch.inference_mode():  # the LM head's all-gather needs every rank
                runner.model.compute_logits(hidden[inp.logits_indices])


def _device_of(config: EngineConfig, rank: int) -> torch.device:
    if config.device.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _share_threads(ranks_on_node: int) -> None:
    """CPU ranks on one machine split its cores instead of each taking them all."""
    torch.set_num_threads(max(1, torch.get_num_threads() // ranks_on_node))


def _worker_main(
    config: EngineConfig, rank: int, rdzv: Rendezvous, local: int, launched: bool
) -> None:
    """Entry point of a worker rank (spawned, or this process on a worker node / launcher)."""
    if config.device.device == "cpu":
        _share_threads(local)
    device = _device_of(config, rank)
    world = config.parallel.tensor_parallel_size
    store = None
    if not launched:  # a launcher's own store is found through the environment (env://)
        store = create_store(rdzv, rank, world)
        store.set(f"pagedllm/ready/{rank}", "1")
    groups = init_tensor_parallel(rank, world, device, rdzv.timeout, store)
    try:
        _serve(config, groups)
    finally:
        groups.destroy()


def _spawned_worker(config: EngineConfig, rank: int, rdzv: Rendezvous, local: int) -> None:
    _worker_main(config, rank, rdzv, local, launched=False)
    # Done and disconnected: skip tearing down torch's modules (seconds) on the way out.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _LocalWorkers:
    """The worker processes this process started, and how to stop them."""

    def __init__(self, config: EngineConfig, place: RankPlacement, rdzv: Rendezvous) -> None:
        ctx = worker_context([__name__, type(config.model.hf_config).__module__])
        local = len(place.local_ranks) + 1
        self.procs: dict[int, mp.Process] = {}
        for rank in place.local_ranks:
            proc = ctx.Process(
                target=_spawned_worker,
                args=(config, rank, rdzv, local),
                name=f"pagedllm-tp{rank}",
                daemon=True,
            )
            proc.start()
            self.procs[rank] = proc

    def describe(self) -> str:
        return ", ".join(f"rank {rank} pid {proc.pid}" for rank, proc in self.procs.items())

    def dead(self, grace: float = 0.0) -> list[tuple[int, int | None, int | None]]:
        """(rank, pid, exit code) of workers that have exited, waiting up to grace seconds."""
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        return [(r, p.pid, p.exitcode) for r, p in self.procs.items() if p.exitcode is not None]

    def await_ready(self, store: dist.Store, timeout: float) -> None:
        """Wait until every local worker reached the rendezvous, failing fast if one died."""
        keys = [f"pagedllm/ready/{rank}" for rank in self.procs]
        deadline = time.monotonic() + timeout
        while keys and not store.check(keys):
            if self.dead() or time.monotonic() > deadline:
                raise WorkerDiedError(_describe(self.dead(), "did not start"))
            time.sleep(0.05)

    def join(self) -> None:
        for proc in self.procs.values():
            proc.join(_JOIN_SECONDS)
            if proc.is_alive():
                proc.terminate()
                proc.join(_JOIN_SECONDS)

    def terminate(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        self.join()


def _describe(dead: list[tuple[int, int | None, int | None]], fallback: str) -> str:
    if not dead:
        return f"a tensor-parallel worker {fallback}"
    parts = []
    for rank, pid, code in dead:
        how = f"was killed by signal {-code}" if code is not None and code < 0 else "exited"
        parts.append(f"rank {rank} (pid {pid}) {how} (exit code {code})")
    return "tensor-parallel worker " + "; ".join(parts)


def _serve_node(config: EngineConfig, place: RankPlacement, rdzv: Rendezvous) -> None:
    """A process whose rank is not 0: serve this node's ranks until the engine stops."""
    workers = _LocalWorkers(config, place, rdzv)
    local = len(place.local_ranks) + 1
    try:
        _worker_main(config, place.rank, rdzv, local, place.launched)
    finally:
        workers.join()


class MultiprocExecutor(Executor):
    """Rank 0 of a tensor-parallel world, in the engine's process; on any other rank a
    handle whose ``run_worker`` serves rank 0 (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        place, rdzv = placement(config.parallel), rendezvous(config.parallel)
        self._config, self._place, self._rdzv = config, place, rdzv
        if place.rank != 0:
            return  # a worker rank: create_executor calls run_worker
        self.comm_overlap = not config.parallel.disable_comm_overlap  # may be flipped per step
        # Below this many tokens a split costs more (twice the collectives, each with its own
        # latency) than the overlap hides; see benchmarks/results/tp.md.
        self.overlap_min_tokens = config.parallel.overlap_min_tokens
        self._error: WorkerDiedError | None = None
        self._threads = torch.get_num_threads()
        if config.device.device == "cpu":
            _share_threads(len(place.local_ranks) + 1)
        store = None if place.launched else create_store(rdzv, 0, place.world_size)
        if store is not None:
            rdzv = dataclasses.replace(rdzv, port=store.port)  # port 0: the one the OS chose
        self._workers = _LocalWorkers(config, place, rdzv)
        # An operator (or a test) that must stop one rank finds it here.
        logger.info("tensor-parallel workers: %s", self._workers.describe())
        groups = None
        try:
            if store is not None:
                self._workers.await_ready(store, rdzv.timeout.total_seconds())
            device = _device_of(config, 0)
            groups = init_tensor_parallel(0, place.world_size, device, rdzv.timeout, store)
            self.runner = ModelRunner.from_engine_config(config, groups.comm)
        except BaseException:
            self._workers.terminate()
            if groups is not None:
                groups.destroy()
            torch.set_num_threads(self._threads)
            raise
        self._groups = groups
        self._finalizer = weakref.finalize(
            self, _stop, self._workers, self._groups, self._threads, False
        )

    @property
    def is_driver(self) -> bool:
        return self._place.rank == 0

    def run_worker(self) -> None:
        """On a rank other than 0: serve this node's ranks until the engine shuts down."""
        assert not self.is_driver, "rank 0 is the driver; it runs steps through execute_model"
        _serve_node(self._config, self._place, self._rdzv)

    def initialize_cache(self) -> KVCacheSpec:
        return self._guard(_agree_num_blocks, self.runner, self._groups.comm)

    def execute_model(self, out: SchedulerOutput) -> ModelOutput:
        self.runner.release(out.finished_seq_ids)  # only rank 0 samples, so only it has state
        inp = self.runner.prepare_input(out)
        overlap = self.comm_overlap and out.num_batched_tokens >= self.overlap_min_tokens
        return self._guard(self._step, inp, overlap)

    def _step(self, inp: ModelInput, overlap: bool) -> ModelOutput:
        _send(self._groups.control, StepInput.from_input(inp, overlap))
        hidden = run_forward(self.runner, inp, self._groups.comm, overlap)
        return self.runner.compute_output(inp, hidden)

    def collective_rpc(self, fn: str | Callable[..., Any], *args: Any) -> list[Any]:
        """Run a ModelRunner method (by name) or ``fn(runner, *args)`` on every rank.

        Returns the results in rank order; ``fn`` must be picklable (a module-level function).
        """
        return self._guard(self._rpc, RpcCall(fn, args))

    def _rpc(self, call: RpcCall) -> list[Any]:
        _send(self._groups.control, call)
        mine = call.apply(self.runner)
        results: list[Any] = [None] * self._groups.comm.world_size
        dist.gather_object(mine, results, dst=0, group=self._groups.control)
        return results

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a step that involves every rank; any failure leaves the engine unusable."""
        if self._error is not None:
            raise self._error
        try:
            return fn(*args)
        except BaseException as e:  # even an interrupt leaves the ranks out of step
            dead = self._workers.dead(grace=2.0)
            self._error = WorkerDiedError(
                f"{_describe(dead, 'failed')}; the engine cannot continue ({e})"
            )
            self._finalizer.detach()
            _stop(self._workers, self._groups, self._threads, True)
            if isinstance(e, Exception):
                raise self._error from e
            raise

    @property
    def dead_error(self) -> WorkerDiedError | None:
        return getattr(self, "_error", None)  # a worker rank's executor has none

    @property
    def worker_pids(self) -> dict[int, int | None]:
        """Rank -> pid of the worker processes this engine started."""
        return {rank: proc.pid for rank, proc in self._workers.procs.items()}

    @property
    def local_runner(self) -> ModelRunner:
        return self.runner

    def shutdown(self) -> None:
        self._finalizer()


def _stop(workers: _LocalWorkers, groups: TensorParallelGroups, threads: int, failed: bool) -> None:
    """Tell the workers to exit (or terminate them after a failure), then leave the world."""
    if failed:
        workers.terminate()
    else:
        try:
            _send(groups.control, None)
        except Exception:  # a worker is already gone; terminate the rest below
            logger.warning("a tensor-parallel worker was gone at shutdown")
        workers.join()
    groups.destroy()
    torch.set_num_threads(threads)

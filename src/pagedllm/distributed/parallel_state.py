"""The tensor-parallel world: where each rank runs, the rendezvous, the process groups.

Ranks are laid out node by node: with ``tensor_parallel_size = N`` over ``nnodes = M``, node k
hosts ranks ``[k * N/M, (k + 1) * N/M)``. The first process on a node takes the node's lowest
rank and starts the others. Rank 0 drives the engine. The rendezvous is torch.distributed's
own: a TCPStore at MASTER_ADDR:MASTER_PORT (flags or environment), hosted by rank 0; under
torchrun (RANK / WORLD_SIZE set) every process is one rank and torchrun's store is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import ParallelConfig
from pagedllm.distributed.communicator import SINGLE, Communicator, OverlapCommunicator

# The tensor-parallel group layers shard over while a model is being built (see
# model_parallel). A ContextVar, so that two engines built in one process never see each
# other's group; outside model_parallel it is the world of one, whose collectives are no-ops.
_TP_GROUP: ContextVar[Communicator] = ContextVar("tensor_parallel_group", default=SINGLE)


def get_tp_group() -> Communicator:
    """The communicator a layer being built shards over and reduces across."""
    return _TP_GROUP.get()


@contextmanager
def model_parallel(comm: Communicator) -> Iterator[Communicator]:
    """Layers built inside this block shard over ``comm`` (the loader sets it)."""
    token = _TP_GROUP.set(comm)
    try:
        yield comm
    finally:
        _TP_GROUP.reset(token)


# Control messages wait for the next engine step, which may come after a long idle spell.
_CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankPlacement:
    """Where this process sits in the tensor-parallel world."""

    rank: int  # global rank of this process
    world_size: int
    local_ranks: tuple[int, ...]  # the other ranks this process starts on its node
    launched: bool  # started by torchrun or alike: the environment names the rank


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int  # 0: rank 0 lets the OS choose (single node only)
    timeout: timedelta  # longest a collective may wait for a peer


def placement(parallel: ParallelConfig) -> RankPlacement:
    """This process's rank and the local ranks it must start."""
    world = parallel.tensor_parallel_size
    launched = envs.launcher_rank()
    if launched is not None:
        rank, launched_world = launched
        if launched_world != world:
            raise ValueError(
                f"the launcher started {launched_world} processes (WORLD_SIZE) but "
                f"tensor_parallel_size is {world}; they must be equal."
            )
        return RankPlacement(rank, world, (), True)
    per_node = world // parallel.nnodes
    first = parallel.node_rank * per_node
    return RankPlacement(first, world, tuple(range(first + 1, first + per_node)), False)


def rendezvous(parallel: ParallelConfig) -> Rendezvous:
    addr = parallel.master_addr or envs.MASTER_ADDR() or "127.0.0.1"
    port = parallel.master_port or envs.MASTER_PORT() or 0
    if parallel.nnodes > 1 and not port:
        raise ValueError(
            "a multi-node engine needs the rendezvous port: pass --master-port (and "
            "--master-addr, the first node's address) or set MASTER_PORT / MASTER_ADDR."
        )
    return Rendezvous(addr, port, timedelta(seconds=envs.PAGEDLLM_TP_TIMEOUT()))


def create_store(rdzv: Rendezvous, rank: int, world_size: int) -> dist.TCPStore:
    """The TCPStore all ranks meet at; rank 0 hosts it (port 0: a free port, see .port)."""
    return dist.TCPStore(
        rdzv.addr,
        rdzv.port,
        world_size,
        is_master=rank == 0,
        timeout=rdzv.timeout,
        wait_for_workers=False,
    )


@dataclass
class TensorParallelGroups:
    comm: OverlapCommunicator  # the device group: gloo on CPU, NCCL on CUDA
    control: object  # a gloo ProcessGroup for step inputs; waits indefinitely while idle
    owns_world: bool  # this engine created the default group and destroys it at shutdown

    def destroy(self) -> None:
        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: timedelta,
    store: dist.Store | None = None,
) -> TensorParallelGroups:
    """Join the world (or reuse one the caller made) and build the groups the engine uses.

    ``store`` None means torchrun's environment (env://) names the rendezvous.
    """
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(
            f"torch.distributed is initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but this engine expects rank {rank} of {world_size}."
        )
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    comm = OverlapCommunicator(rank, world_size, dist.group.WORLD)
    return TensorParallelGroups(comm, control, owns)

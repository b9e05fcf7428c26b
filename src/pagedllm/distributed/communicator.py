"""Collectives of the tensor-parallel group; every call is a no-op at world size 1."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class Communicator:
    """The tensor-parallel group a layer shards over and reduces across."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup; None at world size 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, size: int, what: str) -> int:
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size ({self.world_size})."
            )
        return size // self.world_size


SINGLE = Communicator()


class PendingReduce(Protocol):
    """An all-reduce in flight; ``wait()`` returns the reduced tensor once it is safe to use."""

    def wait(self) -> torch.Tensor: ...


class _Done:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def wait(self) -> torch.Tensor:
        return self.x


class _WorkPending:
    """A gloo all-reduce running on the process group's own threads."""

    def __init__(self, work: dist.Work, x: torch.Tensor) -> None:
        self.work, self.x = work, x
        self.waited = False

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.waited = True
        return self.x


class _StreamPending:
    """An NCCL all-reduce queued on a side stream; waiting orders the current stream after it."""

    def __init__(self, x: torch.Tensor, done: torch.cuda.Event) -> None:
        self.x, self.done = x, done
        self.waited = False

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream(self.x.device).wait_event(self.done)  # no host sync
        self.waited = True
        return self.x


@dataclass
class OverlapCommunicator(Communicator):
    """A communicator whose all-reduce can be issued now and waited for where it is needed.

    On CPU (gloo) the reduction runs on gloo's threads (``async_op``) while this thread keeps
    computing. On CUDA (NCCL) it is queued on a side stream after an event recorded on the
    compute stream, so the compute stream runs on until ``wait()`` orders it after the
    reduction's own event; the host never blocks.
    """

    num_async: int = 0  # all-reduces issued through all_reduce_async (tests, statistics)
    tp_size: int | None = None  # the group's size, as a user names it (sets world_size)
    _side_streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict, repr=False)
    _pending: list[_WorkPending | _StreamPending] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size is not None:
            self.world_size = self.tp_size
            if dist.is_initialized():
                self.rank = dist.get_rank(self.group)

    def all_reduce_async(self, x: torch.Tensor, group: object | None = None) -> PendingReduce:
        """Start summing x in place across ranks (of ``group``, else this communicator's);
        x must not be touched until ``wait()`` on the result, or ``synchronize()``."""
        if self.world_size == 1:
            return _Done(x)
        self.num_async += 1
        group = self.group if group is None else group
        if x.is_cuda:
            pending = self._all_reduce_on_side_stream(x, group)
        else:
            pending = _WorkPending(dist.all_reduce(x, group=group, async_op=True), x)
        # those already waited for by their caller need no synchronize(): keep the list short
        self._pending = [p for p in self._pending if not p.waited]
        self._pending.append(pending)
        return pending

    def synchronize(self) -> None:
        """Wait for every all-reduce issued so far (on CUDA: order the current stream after
        them, without blocking the host)."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.wait()

    def _all_reduce_on_side_stream(self, x: torch.Tensor, group: object) -> PendingReduce:
        side = self._side_streams.get(x.device)
        if side is None:
            side = self._side_streams[x.device] = torch.cuda.Stream(x.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))  # x's producer has been queued
        with torch.cuda.stream(side):
            side.wait_event(ready)
            dist.all_reduce(x, group=group)
            done = torch.cuda.Event()
            done.record(side)
        x.record_stream(side)  # the allocator must not hand x's memory out before `done`
        return _StreamPending(x, done)

"""Collectives of the tensor-parallel group; every call is a no-op at world size 1."""

from __future__ import annotations

from dataclasses import dataclass

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

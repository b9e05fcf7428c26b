"""Communication / computation overlap: two micro-batches interleaved stage by stage.

A model written as a list of *stages* (each ends in a row-parallel matmul whose partial sums
still need an all-reduce) runs over two micro-batches A and B like this::

    A: stage 0 -> all-reduce(A) issued        B: stage 0 -> all-reduce(B) issued
    wait(A); A: stage 1 -> all-reduce issued   wait(B); B: stage 1 -> all-reduce issued ...

so A's reduction is in flight while B computes, and B's while A computes the next stage.
Every rank splits the same batch at the same place, so collectives stay in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.distributed.communicator import OverlapCommunicator, PendingReduce

# (positions, hidden, residual) -> (partial sums awaiting the all-reduce, new residual)
Stage = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [tokens of this micro-batch]
    positions: torch.Tensor  # [tokens of this micro-batch]
    metadata: Any  # the attention metadata of its sequences only, token offsets rebased to 0


def interleave(
    stages: Sequence[Stage],
    batches: Sequence[MicroBatch],
    hidden: list[torch.Tensor],
    comm: OverlapCommunicator,
    context: Callable[[Any], AbstractContextManager[Any]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every stage on every micro-batch in turn; returns each one's (hidden, residual).

    ``hidden[i]`` is micro-batch i's input (already reduced); ``context(metadata)`` is entered
    around each stage of a micro-batch (its attention metadata). A micro-batch waits for its
    own previous reduction only when its next stage needs the result.
    """
    residual: list[torch.Tensor | None] = [None] * len(batches)
    pending: list[PendingReduce | None] = [None] * len(batches)
    for stage in stages:
        for i, batch in enumerate(batches):
            if pending[i] is not None:
                hidden[i] = pending[i].wait()
            with context(batch.metadata):
                partial, residual[i] = stage(batch.positions, hidden[i], residual[i])
            pending[i] = comm.all_reduce_async(partial)
    out = []
    for p, r in zip(pending, residual):
        assert p is not None and r is not None, "interleave needs at least one stage"
        out.append((p.wait(), r))
    return out

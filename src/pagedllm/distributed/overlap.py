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
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.distributed.communicator import OverlapCommunicator, PendingReduce

# (positions, hidden, residual) -> (partial sums awaiting the all-reduce, new residual)
Stage = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [tokens of this micro-batch]
    positions: torch.Tensor  # [tokens of this micro-batch]
    metadata: AttentionMetadata  # its sequences only, token offsets rebased to 0


def split_batch(
    input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
) -> list[MicroBatch] | None:
    """Two micro-batches cut at the sequence boundary nearest half the tokens; None if < 2."""
    query_lens = metadata.query_lens_cpu
    if len(query_lens) < 2:
        return None
    ends = np.cumsum(query_lens)  # token end of each sequence
    # the cut goes after sequence k (1 <= k+1 < num_seqs), nearest to half the tokens
    k = int(np.argmin(np.abs(ends[:-1] - ends[-1] / 2)))
    cut_seq, cut_tok = k + 1, int(ends[k])
    return [
        _slice(input_ids, positions, metadata, 0, cut_seq, 0, cut_tok),
        _slice(input_ids, positions, metadata, cut_seq, len(query_lens), cut_tok, int(ends[-1])),
    ]


def _slice(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    md: AttentionMetadata,
    s0: int,
    s1: int,
    t0: int,
    t1: int,
) -> MicroBatch:
    """Sequences [s0, s1), which own tokens [t0, t1) of the flat batch."""
    query_lens, seq_lens = md.query_lens_cpu[s0:s1], md.seq_lens_cpu[s0:s1]
    metadata = AttentionMetadata(
        query_start_loc=md.query_start_loc[s0 : s1 + 1] - t0,
        seq_lens=md.seq_lens[s0:s1],
        block_tables=md.block_tables[s0:s1],
        slot_mapping=md.slot_mapping[t0:t1],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return MicroBatch(input_ids[t0:t1], positions[t0:t1], metadata)


def interleave(
    stages: Sequence[Stage],
    batches: Sequence[MicroBatch],
    hidden: list[torch.Tensor],
    comm: OverlapCommunicator,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every stage on every micro-batch in turn; returns each one's (hidden, residual).

    ``hidden[i]`` is micro-batch i's input (already reduced). A micro-batch waits for its own
    previous reduction only when its next stage needs the result.
    """
    residual: list[torch.Tensor | None] = [None] * len(batches)
    pending: list[PendingReduce | None] = [None] * len(batches)
    for stage in stages:
        for i, batch in enumerate(batches):
            if pending[i] is not None:
                hidden[i] = pending[i].wait()
            with ForwardContext(batch.metadata):
                partial, residual[i] = stage(batch.positions, hidden[i], residual[i])
            pending[i] = comm.all_reduce_async(partial)
    out = []
    for p, r in zip(pending, residual):
        assert p is not None and r is not None, "interleave needs at least one stage"
        out.append((p.wait(), r))
    return out

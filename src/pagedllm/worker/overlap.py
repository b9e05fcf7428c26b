"""The tensor-parallel forward over two micro-batches whose all-reduces overlap compute.

The model only has to expose its pieces: ``model.model.get_input_embeddings``, decoder layers
whose ``stages()`` are the halves ``forward`` is built from (each taking ``reduce``), and the
final ``norm``. The schedule itself is distributed.overlap.interleave.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.distributed.communicator import OverlapCommunicator
from pagedllm.distributed.overlap import MicroBatch, Stage, interleave


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
    cut_seq, cut_tok, num_tok = k + 1, int(ends[k]), int(ends[-1])
    return [
        MicroBatch(
            input_ids[:cut_tok], positions[:cut_tok], metadata.slice(0, cut_seq, 0, cut_tok)
        ),
        MicroBatch(
            input_ids[cut_tok:],
            positions[cut_tok:],
            metadata.slice(cut_seq, len(query_lens), cut_tok, num_tok),
        ),
    ]


def overlappable(model: nn.Module) -> bool:
    """Whether every decoder layer's halves end in the all-reduce (no norm after it)."""
    return all(layer.stages() is not None for layer in model.model.layers)


def forward_overlapped(
    model: nn.Module, batches: list[MicroBatch], comm: OverlapCommunicator
) -> torch.Tensor:
    """The model's forward over micro-batches whose all-reduces overlap each other's compute;
    the final hidden states [num_tokens, hidden] in the batches' order."""
    inner = model.model
    stages: list[Stage] = [
        functools.partial(stage, reduce=False) for layer in inner.layers for stage in layer.stages()
    ]
    sizes = [len(b.input_ids) for b in batches]
    embedded = inner.get_input_embeddings(torch.cat([b.input_ids for b in batches]))  # one reduce
    hidden = list(embedded.split(sizes))
    outs = interleave(stages, batches, hidden, comm, ForwardContext)
    return torch.cat([inner.norm(h, r)[0] for h, r in outs])

"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communicator import SINGLE, Communicator


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary (padded to divide evenly)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, comm: Communicator = SINGLE
    ) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // comm.world_size)
        self.start = comm.rank * self.rows
        self.weight = nn.Parameter(
            torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = loaded[self.start : self.start + self.rows]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary slice of each rank, gathered into the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        logits = F.linear(hidden, self.weight)
        logits = self.comm.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]

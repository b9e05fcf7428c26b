"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary (padded to divide evenly). The slicing,
masking and collectives are written here once; a quantized layer replaces only how its rows
are read (``lookup``) or multiplied (``local_logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communicator import Communicator
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers import cpu_fused, panel_gemm
from pagedllm.layers.custom_op import current_target


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        comm: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm = comm or get_tp_group()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // comm.world_size)
        self.start = comm.rank * self.rows  # this rank holds rows [start, start + rows)
        self.weight = nn.Parameter(
            torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.cpu_gemv = current_target().uses_cpu_kernels(dtype)  # the LM head's decode rows
        # after loading, a CPU float weight may move into panels (panel_gemm.pack_model)
        self.register_buffer("weight_panels", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = loaded[self.start : self.start + self.rows]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def packs_into_panels(self) -> bool:
        """A float table (not a quantized class) whose loaded CPU weight splits into panels."""
        plain = (
            type(self) in (VocabParallelEmbedding, ParallelLMHead) and self.weight_panels is None
        )
        return plain and panel_gemm.packable(self.weight)

    def fused_lookup(self) -> tuple[int, list[torch.Tensor | None], int] | None:
        """How the fused CPU decoder looks tokens up here (worker/cpu_decoder.py's
        ModelEnds, csrc/fused_ops.cpp's embedding kinds): (kind, [a, b, c], bits), or None
        where it cannot (under tensor parallelism, or a class with a lookup of its own)."""
        if self.comm.world_size != 1 or type(self).lookup is not VocabParallelEmbedding.lookup:
            return None
        if self.weight_panels is not None:
            return 1, [self.weight_panels, None, None], 0
        return 0, [self.weight, None, None], 0

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's slice: [n] local ids -> [n, hidden]."""
        if self.weight_panels is not None:
            return panel_gemm.rows(self.weight_panels, local_ids)
        return F.embedding(local_ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary slice of each rank, gathered into the full vocabulary."""

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, rows]
        if self.weight_panels is not None:
            return panel_gemm.linear(hidden, self.weight_panels, None)
        if self.cpu_gemv and cpu_fused.gemv_takes(hidden):  # a few rows on the CPU (decode)
            return cpu_fused.gemv(hidden, self.weight, None)
        if self.cpu_gemv:
            return cpu_fused.float_linear(hidden, self.weight, None)
        return F.linear(hidden, self.weight)

    def fused_operands(self) -> tuple[list[torch.Tensor | None], int] | None:
        """How the fused CPU decoder computes these logits (worker/cpu_decoder.py): as a
        decoder layer's linear, ([weight, rowsum, scale, bias], activation level), or None
        where it cannot (under tensor parallelism, or a float weight that local_logits
        multiplies with F.linear)."""
        if self.comm.world_size != 1:
            return None
        if self.weight_panels is not None:
            return [self.weight_panels, None, None, None], 0
        if self.cpu_gemv:
            return [self.weight, None, None, None], 0
        return None

    def forward(
        self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """The logits, in hidden's dtype or out_dtype (float32 for sampling: from bfloat16
        panels the product writes the widened bfloat16 logits itself, one pass fewer)."""
        if out_dtype is not None and self.weight_panels is not None:
            local = panel_gemm.linear(hidden, self.weight_panels, None, out_dtype=out_dtype)
        else:
            local = self.local_logits(hidden)
            local = local if out_dtype is None else local.to(out_dtype)
        logits = self.comm.all_gather(local, dim=-1)
        return logits[:, : self.vocab_size]

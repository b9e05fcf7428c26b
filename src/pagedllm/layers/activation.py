"""SwiGLU on a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import cpu_fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if x.dim() == 2 and x.stride(1) == 1 and cpu_fused.usable(x):
            return cpu_fused.silu_and_mul(x)  # one pass, no thread pool for a few rows
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one temporary less per layer

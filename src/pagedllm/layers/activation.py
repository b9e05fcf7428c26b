"""SwiGLU on a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one temporary less per layer

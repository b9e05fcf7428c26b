"""Gated activations on a merged [gate | up] projection: SwiGLU and GeGLU (tanh GELU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_fused
from pagedllm.layers.custom_op import CustomOp, triton_ops


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one temporary less per layer

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return self.forward_native(x)
        return cpu_fused.silu_and_mul(x)  # one pass, no thread pool for a few rows

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return self.forward_native(x)
        return triton_ops().silu_and_mul(x)  # one launch for silu, the product and rounding


class GeluTanhAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            return self.forward_native(x)
        return cpu_fused.gelu_tanh_and_mul(x)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}

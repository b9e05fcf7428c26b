"""The "triton" attention backend: the Triton kernel over the paged cache (CUDA)."""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.attention import triton_kernels
from pagedllm.attention.backend import VarlenKernelBackend


class TritonAttentionBackend(VarlenKernelBackend):
    name = "triton"
    kernel = staticmethod(triton_kernels.varlen_attention)

    @classmethod
    def supports(cls, query: torch.Tensor, key: torch.Tensor) -> bool:
        """CUDA tensors (or any, under Triton's CPU interpreter)."""
        return query.device.type == "cuda" or envs.TRITON_INTERPRET()

"""The "triton" attention backend: the Triton kernel over the paged cache (CUDA)."""

from __future__ import annotations

from pagedllm.attention import triton_kernels
from pagedllm.attention.backend import VarlenKernelBackend


class TritonAttentionBackend(VarlenKernelBackend):
    name = "triton"
    kernel = staticmethod(triton_kernels.varlen_attention)

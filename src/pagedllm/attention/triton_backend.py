"""The "triton" attention backend: the Triton kernel over the paged cache (CUDA)."""

from __future__ import annotations

import torch

from pagedllm.attention import triton_kernels
from pagedllm.attention.backend import AttentionBackend, PagedAttentionCall
from pagedllm.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def attend(self, call: PagedAttentionCall, metadata: AttentionMetadata) -> torch.Tensor:
        out, _ = triton_kernels.varlen_attention(
            call.query, call.key_cache, call.value_cache, metadata.batch, call.scale,
            call.window_left, 0,
        )  # fmt: skip
        return out

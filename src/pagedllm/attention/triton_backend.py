"""The "triton" attention backend: the Triton kernel over the paged cache (CUDA)."""

from __future__ import annotations

import torch

from pagedllm.attention import triton_kernels
from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, VarlenBatch
from pagedllm.attention.torch_backend import write_kv_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window_left: int,
    ) -> torch.Tensor:
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        batch = VarlenBatch.from_metadata(metadata)
        out, _ = triton_kernels.varlen_attention(
            query, key_cache, value_cache, batch, scale, window_left, 0
        )
        return out

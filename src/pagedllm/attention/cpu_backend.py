"""The "cpu" attention backend: the C++ kernel over the paged cache, in one call per layer.

Prefill (with or without a cached prefix), chunked prefill and decode rows of a step go through
the same call; K/V blocks are read in place through the block table (no gather copy). Without a
working C++ toolchain it behaves exactly as the "torch" backend.
"""

from __future__ import annotations

import torch

from pagedllm.attention import cpu_kernels
from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, VarlenBatch
from pagedllm.attention.torch_backend import TorchAttentionBackend, write_kv_cache


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._kernel = cpu_kernels.load()
        self._torch = TorchAttentionBackend()  # without the kernel, or for inputs it rejects

    @property
    def uses_kernel(self) -> bool:
        """False when the C++ kernel could not be built: every call then takes the torch path."""
        return self._kernel

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
        if not (self._kernel and cpu_kernels.supports(query, key_cache)):
            return self._torch.forward(
                query, key, value, key_cache, value_cache, metadata, scale, window_left
            )
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        batch = VarlenBatch.from_metadata(metadata)
        out, _ = cpu_kernels.varlen_attention(
            query, key_cache, value_cache, batch, scale, window_left, 0
        )
        return out

"""The "cpu" attention backend: the C++ kernel over the paged cache, in one call per layer.

Prefill (with or without a cached prefix), chunked prefill and decode rows of a step go through
the same call; K/V blocks are read in place through the block table (no gather copy). Without a
working C++ toolchain it behaves exactly as the "torch" backend.
"""

from __future__ import annotations

import torch

from pagedllm.attention import cpu_kernels
from pagedllm.attention.backend import AttentionBackend, VarlenKernelBackend
from pagedllm.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(VarlenKernelBackend):
    name = "cpu"
    kernel = staticmethod(cpu_kernels.varlen_attention)

    def __init__(self, tiles: str | None = None) -> None:
        super().__init__(tiles)
        self._kernel = cpu_kernels.load()
        self._torch = TorchAttentionBackend()  # without the kernel, or for inputs it rejects

    @classmethod
    def supports(cls, query: torch.Tensor, key: torch.Tensor) -> bool:
        return cpu_kernels.supports(query, key) and cpu_kernels.load()

    def delegate(self, query: torch.Tensor, key_cache: torch.Tensor) -> AttentionBackend | None:
        if self._kernel and cpu_kernels.supports(query, key_cache):  # load() ran in __init__
            return None
        return self._torch

    def cpu_kernel_tiles(
        self, dtype: torch.dtype, num_heads: int, key_cache: torch.Tensor
    ) -> tuple[int, int] | None:
        head_dim = key_cache.shape[-1]
        query = torch.empty(0, num_heads, head_dim, dtype=dtype)
        if key_cache.dim() != 4 or self.delegate(query, key_cache) is not None:
            return None
        tuning = self.tuning(query, key_cache)  # what attend hands the kernel
        return tuning.block_m, tuning.block_n

    @property
    def uses_kernel(self) -> bool:
        """False when the C++ kernel could not be built: every call then takes the torch path."""
        return self._kernel

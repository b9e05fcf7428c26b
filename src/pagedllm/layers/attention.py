"""The attention layer: binds a model's attention to a backend and its slice of the KV cache."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import ForwardContext


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window_left: int = -1
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window_left = window_left  # flash-attn convention: -1 = unlimited
        self.kv_group = 0  # the KV cache group whose blocks hold this layer's K/V
        # Bound by the model runner once the cache exists.
        self.backend: AttentionBackend | None = None
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads * head_dim], k / v [T, kv_heads * head_dim] -> [T, heads * head_dim].
        A cache of another dtype than q's (kv_cache_dtype) takes q, k and v in its dtype:
        attention runs in it and its output comes back in q's."""
        assert self.backend is not None, "KV cache not bound"
        num_tokens, dtype = q.shape[0], q.dtype
        if self.key_cache.dtype != dtype:
            q, k, v = (t.to(self.key_cache.dtype) for t in (q, k, v))
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.key_cache,
            self.value_cache,
            ForwardContext.get().for_group(self.kv_group),
            self.scale,
            self.window_left,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim).to(dtype)

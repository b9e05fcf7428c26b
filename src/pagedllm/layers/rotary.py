"""Rotary position embeddings (neox layout, as HF Llama), with linear and llama3 scaling."""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch

from pagedllm.layers import cpu_fused
from pagedllm.layers.custom_op import CustomOp, triton_ops


def rope_parameters(
    hf_config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the new or the old config field names; with
    layer_type, that kind of layer's (Gemma 3: "sliding_attention" layers have their own base,
    rope_local_base_freq in older configs, and no scaling)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    theta = getattr(hf_config, "rope_theta", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]  # per layer type (transformers >= 5 layout)
    elif layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
        return float(hf_config.rope_local_base_freq), None
    if params and "rope_theta" in params:
        theta = params["rope_theta"]
    scaling = None
    if params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    return float(theta or 10000.0), scaling


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3).")


# (head_dim, positions, theta, scaling, dtype, device, "cos" | "sin") -> table. Layers of one
# kind share their tables (a 32k-position Gemma 3 table of 256 dims is 32 MiB a layer); held
# weakly, so the tables go with the last model that uses them.
_TABLES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _tables(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: dict[str, Any] | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [max_position, head_dim] on the current default device, shared."""
    device = str(torch.empty(0).device)
    key = (head_dim, max_position, theta, json.dumps(scaling, sort_keys=True), dtype, device)
    cos, sin = _TABLES.get((*key, "cos")), _TABLES.get((*key, "sin"))
    if cos is None or sin is None:
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        _TABLES[(*key, "cos")], _TABLES[(*key, "sin")] = cos, sin
    return cos, sin


class RotaryEmbedding(CustomOp):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(dtype)
        self.head_dim, self.max_position, self.theta, self.scaling = (
            head_dim,
            max_position,
            theta,
            scaling,
        )
        self.register_buffer("cos", torch.empty(0, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(0, dtype=dtype), persistent=False)
        self.reset_buffers(dtype)

    def reset_buffers(self, dtype: torch.dtype | None = None) -> None:
        """Compute the cos / sin tables where the module lives (again after the loader moves a
        model built on the meta device)."""
        dtype = dtype or self.cos.dtype
        if torch.empty(0).device.type == "meta":
            # Built on the meta device: shapes only. Computing the tables there runs torch's
            # Python reference ops, whose first use imports torch._dynamo and sympy (seconds
            # of start-up); the loader calls this again on the real device.
            self.cos = torch.empty(self.max_position, self.head_dim, dtype=dtype)
            self.sin = torch.empty(self.max_position, self.head_dim, dtype=dtype)
            return
        self.cos, self.sin = _tables(self.head_dim, self.max_position, self.theta,
                                     self.scaling, dtype)  # fmt: skip

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k [T, kv_heads, head_dim] rotated by their positions."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def forward_cpu(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.stride(-1) != 1 or k.stride(-1) != 1 or q.dtype != self.cos.dtype:
            return self.forward_native(positions, q, k)
        return cpu_fused.rotary_neox(positions.contiguous(), q, k, self.cos, self.sin)

    def forward_cuda(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.stride(-1) != 1 or k.stride(-1) != 1 or q.dtype != self.cos.dtype:
            return self.forward_native(positions, q, k)
        return triton_ops().rotary_neox(positions.contiguous(), q, k, self.cos, self.sin)

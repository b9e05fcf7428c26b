"""RMSNorm: with the residual add fused in as the decoder layers use it, or alone.

``offset`` is Gemma's form, ``x_normed * (1 + weight)`` computed in float32 and rounded once;
without it Llama's ``weight * x_normed``, with x_normed rounded to the dtype first.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import cpu_fused
from pagedllm.layers.custom_op import CustomOp, triton_ops


class RMSNorm(CustomOp):
    """forward(x, residual) -> (norm(x + residual), x + residual); residual None: x starts it."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, offset: bool = False
    ) -> None:
        super().__init__(dtype)
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass, in place: x and residual are the layer's own temporaries (the first call
        copies x, which may be the caller's tensor)."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != self.weight.dtype:
            return self.forward_native(x, residual)
        if residual is None:
            residual, x = torch.zeros_like(x), x.clone()
        return cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch (layers/triton_ops.py) for the add, the norm and the weight."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != self.weight.dtype:
            return self.forward_native(x, residual)
        if residual is not None and (residual.stride(1) != 1 or residual.dtype != x.dtype):
            return self.forward_native(x, residual)
        return triton_ops().add_rms_norm(x, residual, self.weight, self.eps, self.offset)


class PlainRMSNorm(RMSNorm):
    """forward(x) -> norm(x) over the last dim: the norms after attention or the MLP (Gemma)
    and the per-head q / k norms (Qwen3, Gemma 3; x [T, heads, head_dim])."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._norm(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.stride(-1) != 1 or x.dtype != self.weight.dtype:
            return self._norm(x)
        rows = x.reshape(-1, x.shape[-1])  # per-head q / k: a copy of the strided view
        return cpu_fused.rms_norm(rows, self.weight, self.eps, self.offset).view(x.shape)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.stride(-1) != 1 or x.dtype != self.weight.dtype:
            return self._norm(x)
        rows = x.reshape(-1, x.shape[-1])
        out, _ = triton_ops().add_rms_norm(rows, None, self.weight, self.eps, self.offset)
        return out.view(x.shape)

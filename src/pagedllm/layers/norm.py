"""RMSNorm, with the residual add fused in as the decoder layers use it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual None means x starts it.

        On CPU the C++ kernel does it in one pass, in place: x and residual are the layer's
        own temporaries (the first call copies x, which may be the caller's tensor)."""
        if self._fusable(x, residual):
            if residual is None:
                residual, x = torch.zeros_like(x), x.clone()
            return cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def fused_operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) for the fused CPU decoder layers, which take activations in dtype."""
        return (self.weight, self.eps) if self.weight.dtype == dtype else None

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            x.dim() == 2
            and x.stride(1) == 1
            and x.dtype == self.weight.dtype
            and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1))
            and cpu_fused.usable(x)
        )

"""What the weight-only panels compute on int8 activations (layers/csrc/panel_gemm.cpp)."""

from __future__ import annotations

import torch

from pagedllm.layers import panel_gemm, weight_only


def int8_activations_on() -> bool:
    """Whether up to 4 rows of x go through the VNNI path here (the CPU has it, it is on)."""
    return panel_gemm.available() and panel_gemm.int8_activations()


def int8_activation_reference(x: torch.Tensor, packed: weight_only.PackedWeight) -> torch.Tensor:
    """x W^T as the VNNI path computes it, in float64: x rounded to int8 per block of 32
    (scale max|x| / 127, llama.cpp's q8_1) times the dequantized weight."""
    k = packed.shape[1]
    xf = x.float().view(x.shape[0], k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.round(xf * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    xq = (q.double() * (amax / 127.0).double()).view(x.shape[0], k)
    return xq @ weight_only.by_rows(packed).dequantize().double().T

"""What weight-only products compute on int8 activations (layers/csrc/panel_gemm.cpp in
panels, layers/csrc/weight_only_gemm.cpp by rows)."""

from __future__ import annotations

import torch

from pagedllm.layers import panel_gemm, weight_only


def panels_on_vnni() -> bool:
    """Whether weight-only panels run here and multiply x on int8 (AVX512-VNNI and VBMI)."""
    return panel_gemm.quantized_available() and panel_gemm.int8_activations_available()


def int8_activations_on() -> bool:
    """Whether up to 4 rows of x go on int8 here: weights in panels on AVX512-VNNI, by rows
    in groups of 32 on AVX2 (the CPU has it, it is on)."""
    return weight_only.int8_activations()


def int8_activation_reference(x: torch.Tensor, packed: weight_only.PackedWeight) -> torch.Tensor:
    """x W^T as the int8 paths compute it, in float64: x rounded to int8 per block of 32
    (scale max|x| / 127, llama.cpp's q8_1) times the dequantized weight."""
    k = packed.shape[1]
    xf = x.float().view(x.shape[0], k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.round(xf * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    xq = (q.double() * (amax / 127.0).double()).view(x.shape[0], k)
    return xq @ weight_only.by_rows(packed).dequantize().double().T

"""The C++ fused ops for CPU (csrc/fused_ops.cpp), built on first use (pagedllm.cpp_build).

Residual add + RMSNorm (plain or offset), RMSNorm alone, the rotary embedding of q and k,
SiLU / GELU(tanh) and mul, a one-row GEMV: each one pass and one parallel region in place of
several small ATen ops (each a pass over memory and a thread-pool round trip); and the float
product past the GEMV's row (float_linear: ATen's but for bf16 without bf16 instructions).
The layers' ``forward_cpu`` (layers/custom_op.py) calls these; the runner's fused decoder
(worker/cpu_decoder.py) calls the same kernels from C++ for every layer of a step. Which of
them runs is decided when a layer is built, never here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedllm.cpp_build import arch_flags, load_library

_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (*DTYPES, torch.float16)  # a KV cache's: q, K, V and the output converted


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the ops; False if that fails."""
    cflags = ["-O3", "-fopenmp", "-ffp-contract=off", *arch_flags()]
    name = load_library(_SOURCE, cflags, "pagedllm_fused", "C++ fused CPU ops", "torch ops")
    return name is not None


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = rms_norm(residual) * weight (offset: * (1 + weight))."""
    torch.ops.pagedllm_fused.fused_add_rms_norm(x, residual, weight, eps, offset)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """rms_norm(x) * weight (offset: * (1 + weight)) of x [R, D] into a new tensor."""
    return torch.ops.pagedllm_fused.rms_norm(x, weight, eps, offset)


def rotary_neox(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hk, D] rotated into new contiguous tensors."""
    return torch.ops.pagedllm_fused.rotary_neox(positions, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [T, 2 * d] = [gate | up] -> [T, d]."""
    return torch.ops.pagedllm_fused.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up of x [T, 2 * d] = [gate | up] -> [T, d]."""
    return torch.ops.pagedllm_fused.gelu_tanh_and_mul(x)


GEMV_USE_ROWS = 1  # where it beats F.linear (at 2-4 rows its loop is compute-bound)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] W^T + bias for M <= 4 (float32 sums), streaming the weight once."""
    return torch.ops.pagedllm_fused.gemv(x, weight, bias)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + bias past the GEMV's one row: F.linear's product, except bf16 where the build has
    no AVX-512 (no bf16 instructions), which takes the bf16 GEMV a few rows a pass or a weight
    widened to fp32 a slab at a time, where ATen's bf16 GEMM ran 4-6x slower."""
    return torch.ops.pagedllm_fused.float_linear(x, weight, bias)


def gemv_takes(x: torch.Tensor) -> bool:
    """Whether a layer built for the GEMV (a CPU float weight of x's dtype) runs x with it."""
    return x.dim() == 2 and x.shape[0] <= GEMV_USE_ROWS and x.stride(1) == 1


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of fp32 rows [n, vocab] (the first of equal maxima, NaN as torch
    counts it), in one vectorized pass: greedy sampling's pick. Other inputs: torch's."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return torch.ops.pagedllm_fused.argmax_rows(logits.contiguous())


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """A token from each fp32 row of logits [n, vocab] (int64 [n]): its argmax where
    temperature is 0, else the token whose place in the row's filtered distribution (top_k,
    0 for none; top_p; min_p, 0 for none) uniform [n] (float64 in [0, 1)) gives, counting the
    kept tokens in index order. Sampler's filters, one uniform number a row."""
    return torch.ops.pagedllm_fused.sample_rows(
        logits.contiguous(), temperature, top_k, top_p, min_p, uniform
    )

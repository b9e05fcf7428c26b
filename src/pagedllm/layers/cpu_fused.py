"""The C++ fused ops for CPU (csrc/fused_ops.cpp), built on first use.

Residual add + RMSNorm, and the rotary embedding of q and k, each one pass and one parallel
region in place of several small ATen ops (each a pass over memory and a thread-pool round
trip). And the decoder layers of a model in one call (:func:`decoder_layers`): the same
kernels in the same order as the layers' Python forward, without its per-module overhead,
which at batch 1 costs about as much as the products. Built like the attention kernel
(torch.utils.cpp_extension, cached per instruction set); when it cannot be built, or
PAGEDLLM_CPU_FUSED_OPS=0, the layers keep their torch ops.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.cpu_kernels import _arch_flags, load_cpp_ops
from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the ops; False if that fails."""
    cflags = ["-O3", "-fopenmp", "-ffp-contract=off", *_arch_flags()]
    try:
        name = load_cpp_ops(_SOURCE, cflags, "pagedllm_fused", "C++ fused CPU ops")
    except Exception as exc:  # no compiler, no ninja, or a build error: the torch ops work
        warnings.warn(
            f"CPU fused ops unavailable ({type(exc).__name__}: {exc}); using torch ops",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    logger.info("CPU fused ops loaded (%s)", name)
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels take x: on CPU, in a dtype they have, switched on, built."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.is_grad_enabled()
        and envs.PAGEDLLM_CPU_FUSED_OPS()
        and load()
    )


def decoder_usable(x: torch.Tensor) -> bool:
    """Whether :func:`decoder_layers` may run on activations like x."""
    return envs.PAGEDLLM_CPU_FUSED_DECODER() and usable(x)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = weight * rms_norm(residual); returns (x, residual)."""
    torch.ops.pagedllm_fused.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


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


@dataclass
class DecoderOperands:
    """The flat operand lists of :func:`decoder_layers`, layer after layer (the layout is
    csrc/fused_ops.cpp's: per layer 22 tensors, 10 ints and 3 floats)."""

    tensors: list[torch.Tensor | None] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)

    def add_layer(
        self,
        norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]],
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention: tuple[list[torch.Tensor], list[int], float],
        linears: list[tuple[list[torch.Tensor | None], int]],
    ) -> None:
        """One layer: (input, post-attention) norms as (weight, eps), rotary (cos, sin), the
        attention layer's operands, and the qkv, o, gate_up and down linears' operands."""
        (in_w, in_eps), (post_w, post_eps) = norms
        caches, attn_ints, scale = attention
        self.tensors += [in_w, post_w, *rotary, *caches]
        for tensors, _ in linears:
            self.tensors += tensors
        self.ints += attn_ints + [levels for _, levels in linears]
        self.floats += [in_eps, post_eps, scale]


def decoder_layers(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    operands: DecoderOperands,
    metadata: AttentionMetadata,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of ``operands`` over the step's tokens: (hidden, residual) after the
    last, as the layers' own forward would return them (the final norm is the caller's);
    residual None: the first layer starts the residual stream."""
    batch = metadata.batch
    return torch.ops.pagedllm_fused.decoder_layers(
        hidden,
        residual,
        positions.contiguous(),
        operands.tensors,
        operands.ints,
        operands.floats,
        metadata.slot_mapping,
        batch.cu_seqlens_q.contiguous(),
        batch.seq_lens_k.contiguous(),
        metadata.block_table,
    )


GEMV_USE_ROWS = 1  # where it beats F.linear (at 2-4 rows its loop is compute-bound)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] W^T + bias for M <= 4 (float32 sums), streaming the weight once."""
    return torch.ops.pagedllm_fused.gemv(x, weight, bias)


def gemv_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers run this product with :func:`gemv` instead of F.linear."""
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_USE_ROWS
        and x.stride(1) == 1
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and usable(x)
    )

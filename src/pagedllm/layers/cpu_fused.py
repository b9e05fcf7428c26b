"""The C++ fused elementwise ops for CPU (csrc/fused_ops.cpp), built on first use.

Residual add + RMSNorm, and the rotary embedding of q and k, each one pass and one parallel
region in place of several small ATen ops (each a pass over memory and a thread-pool round
trip). Built like the attention kernel (torch.utils.cpp_extension, cached per instruction
set); when it cannot be built, or PAGEDLLM_CPU_FUSED_OPS=0, the layers keep their torch ops.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.cpu_kernels import _arch_flags, _cpu_fingerprint

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the ops; False if that fails."""
    arch = _arch_flags()
    name = "pagedllm_fused_" + (_cpu_fingerprint() if arch else "generic")
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *arch],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
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

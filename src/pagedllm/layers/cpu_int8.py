"""The C++ int8 GEMM (csrc/int8_gemm.cpp): a whole int8 linear layer in one call.

At decode a linear layer sees a handful of rows; there the oneDNN path's per-call torch ops
(observer, rounding, zero point, rescale) cost more than the product itself. This kernel does
the whole layer in one call with the same arithmetic (per-token int8 activations, exact int32
sums), so its results equal the oneDNN kernel's. Built on first use like the attention
kernel; the instruction set (AVX-512 VNNI, AVX-VNNI, AVX-512BW, AVX2, portable) is picked at
run time, so one build serves any x86 CPU.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from pagedllm.cpp_build import load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "int8_gemm.cpp"


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the kernel; False if that fails."""
    what = "C++ int8 GEMM kernel"
    flags = ["-O3", "-fopenmp"]
    if load_library(_SOURCE, flags, "pagedllm_int8", what, "oneDNN for every batch size") is None:
        return False  # no compiler or ninja: the oneDNN path still works
    logger.info("%s: %s", what, isa())
    return True


def isa() -> str:
    """The instruction set the kernel runs: avx512_vnni | avx_vnni | avx512bw | avx2 | scalar."""
    return torch.ops.pagedllm_int8.isa()


def has_vnni() -> bool:
    return isa() in ("avx512_vnni", "avx_vnni")


def pair_passes() -> int:
    """Passes of the AVX-512 VNNI kernel over two weight blocks at once (products of more than
    two rows) run so far in this process. load() must be True."""
    return int(torch.ops.pagedllm_int8.pair_passes())


def ahead_lines() -> int:
    """64-byte lines of weight that the two-block passes (more than two rows on AVX-512 VNNI)
    have requested a pair of blocks ahead so far in this process. load() must be True."""
    return int(torch.ops.pagedllm_int8.ahead_lines())


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (packed blocks, int32 row sums) for :func:`linear`."""
    return torch.ops.pagedllm_int8.int8_pack(weight)


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The int8 [N, K] weight back from :func:`pack`'s blocks (saving, tests)."""
    blocks, groups = packed.shape[:2]
    full = packed.view(blocks, groups, 16, 4).permute(0, 2, 1, 3).reshape(blocks * 16, groups * 4)
    return full[: shape[0], : shape[1]].contiguous()


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    rowsum: torch.Tensor,
    scale: torch.Tensor,
    levels: int,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x fp32 or bf16 [M, K] -> [M, N] in x's dtype: per-row int8 activations (|q| <=
    levels) times the packed weight, rescaled by each row's step and the weight's per-row
    scale (a bf16 y is the fp32 one rounded to nearest even). isa forces an instruction set
    the CPU runs (tests); None takes the best."""
    return torch.ops.pagedllm_int8.int8_linear(x, packed, rowsum, scale, levels, bias, isa)


ISAS = ("avx512_vnni", "avx_vnni", "avx512bw", "avx2", "scalar")

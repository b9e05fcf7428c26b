"""The C++ CPU attention kernel (csrc/attention.cpp), built on first use.

torch.utils.cpp_extension compiles it once into the torch extensions cache (about 15 s of one
core; later processes only load it). When no compiler or ninja is there, :func:`load` warns
once and returns False, and callers take the torch path instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import warnings
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import AttentionTuning, get_tuning

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _arch_flags() -> list[str]:
    """-march=native where the compiler knows it, unless PAGEDLLM_CPU_NATIVE_ARCH=0."""
    if not envs.PAGEDLLM_CPU_NATIVE_ARCH():
        return []
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_fingerprint() -> str:
    """Names the build after the instruction set: a shared cache never serves a foreign one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), text)
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the kernel; False if that fails."""
    arch = _arch_flags()
    name = "pagedllm_attention_" + (_cpu_fingerprint() if arch else "generic")
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", *arch],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, or a build error: the torch path works
        warnings.warn(
            f"CPU attention kernels unavailable ({type(exc).__name__}: {exc}); "
            "using the torch attention path",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    logger.info("CPU attention kernels loaded (%s)", name)
    return True


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs (the C++ loops step 16 head dims at a time)."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and key.dtype == query.dtype
        and query.shape[-1] % 16 == 0
    )


def varlen_attention(
    query: torch.Tensor,  # [total_q, heads, head_dim]
    key: torch.Tensor,  # [total_k, kv_heads, head_dim] or paged [blocks, block_size, ...]
    value: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out like query, lse [heads, total_q] fp32
    """Attention of a varlen batch in one call of the C++ kernel (load() must be True)."""
    heads, head_dim = query.shape[1:]
    if tuning is None:
        group = heads // key.shape[-2]
        tuning = get_tuning("cpu", head_dim, group, query.dtype)
    out = torch.empty_like(query)
    lse = torch.empty(heads, query.shape[0], dtype=torch.float32) if return_lse else None
    torch.ops.pagedllm_attention.varlen_attention(
        query,
        key,
        value,
        out,
        batch.cu_seqlens_q.contiguous(),
        batch.seq_lens_k.contiguous(),
        None if batch.cu_seqlens_k is None else batch.cu_seqlens_k.contiguous(),
        batch.block_table,
        lse,
        scale,
        window_left,
        window_right,
        tuning.block_m,
        tuning.block_n,
    )
    return out, lse

"""The C++ CPU attention kernel (csrc/attention.cpp), built on first use (pagedllm.cpp_build).

When no compiler or ninja is there, :func:`load` warns once and returns False, and callers
take the torch path instead.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import AttentionTuning, env_tiles, get_tuning
from pagedllm.cpp_build import arch_flags, load_library

_SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load() -> bool:
    """Load the kernel, building it first if no process has yet; False if that fails."""
    loaded = (
        load_library(
            _SOURCE,
            ["-O3", "-fopenmp", *arch_flags()],
            "pagedllm_attention",
            "C++ CPU attention kernel",
            "the torch attention path",
        )  # fmt: skip
        is not None
    )
    if loaded and not envs.PAGEDLLM_CPU_BF16_DOT_ATTENTION():
        torch.ops.pagedllm_attention.bf16_dot(0)
    if loaded and not envs.PAGEDLLM_CPU_AMX_ATTENTION():
        torch.ops.pagedllm_attention.amx(0)
    return loaded


def bf16_dot(enable: bool | None = None) -> bool:
    """Whether bf16 attention runs on vdpbf16ps (the CPU has AVX512-BF16 and the path is
    on); ``enable`` turns the path on or off for the process first. load() must be True."""
    return bool(torch.ops.pagedllm_attention.bf16_dot(-1 if enable is None else int(enable)))


def amx(enable: bool | None = None) -> bool:
    """Whether the bf16 path's many-row products (prefill tiles, shared prefixes) run on AMX
    tiles (the CPU has AMX-BF16 and Linux grants this process the tile state, and they are
    on); ``enable`` turns them on or off for the process first. load() must be True."""
    return bool(torch.ops.pagedllm_attention.amx(-1 if enable is None else int(enable)))


def amx_tiles() -> int:
    """Key tiles whose many-row products ran on AMX tiles so far in this process.
    load() must be True."""
    return int(torch.ops.pagedllm_attention.amx_tiles())


def split_merges() -> int:
    """Split-key groups merged so far in this process: decode batches with too few (sequence,
    kv head) items for the threads split each one's keys into chunks. load() must be True."""
    return int(torch.ops.pagedllm_attention.split_merges())


def shared_prefix_items() -> int:
    """Shared-prefix items run so far in this process: at least 4 sequences of one query tile
    whose block tables begin with the same blocks (64 keys or more, before their queries) have
    that prefix attended once for all their rows, merged with each one's own keys (bf16 K/V on
    the vdpbf16ps path, paged, no left window). load() must be True."""
    return int(torch.ops.pagedllm_attention.shared_prefix_items())


def tile_keys() -> int:
    """Keys the kernel's tiles have scored so far in this process, each tile's count padded
    to a multiple of 16 on the vdpbf16ps path, of 8 on the vector path (the keys a tile
    computes, masked beyond its valid ones). load() must be True."""
    return int(torch.ops.pagedllm_attention.tile_keys())


def key_tiles() -> int:
    """Key tiles the kernel has run so far in this process (each a pass of the online softmax
    over up to block_n keys of one item, the last up to block_n / 2 longer; twice those on
    the vdpbf16ps path's many-row tiles). load() must be True."""
    return int(torch.ops.pagedllm_attention.key_tiles())


def gemm_tiles() -> int:
    """Key tiles scored as a small GEMM so far in this process (many query rows a tile,
    prefill's: keys transposed once; on the vdpbf16ps path V pairs interleaved once too).
    load() must be True."""
    return int(torch.ops.pagedllm_attention.gemm_tiles())


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
        tuning = get_tuning("cpu", head_dim, group, query.dtype, env_tiles())
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

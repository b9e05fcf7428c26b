"""Tile sizes of the attention kernels, derived from the device's caches.

The rule (one place, so that the figures in the docs match the code):

CPU (the C++ kernels; a work item is one query tile of one sequence against its keys):
- ``block_n`` keys per tile: the largest power of two in [16, 256] such that one head's K and
  V tile in fp32 (``2 * block_n * head_dim * 4`` bytes) fill at most the L1 data cache; the
  scores of the tile are computed, exponentiated and consumed while K/V are still there.
- ``block_m`` query tokens per tile: the largest power of two in [16, 128] such that the tile's
  fp32 query and output rows (``2 * block_m * group * head_dim * 4`` bytes, ``group`` = query
  heads per KV head) take at most a quarter of L2: they are reread for every key tile, and the
  rest of L2 holds the K/V tiles in flight (measured: a half-L2 tile ran 25% slower).
- ``num_stages`` 2: the next key tile is prefetched while the current one is computed.

CUDA (the Triton kernels):
- ``block_m`` rows (query tokens x group heads) 128 when a block may use >= 128 KiB of shared
  memory and head_dim <= 128, else 64; ``block_n`` 64 for head_dim <= 128, else 32.
- ``num_stages``: as many K/V tiles (``2 * block_n * head_dim * elem`` bytes each) as fit in
  the shared memory left after the query tile, between 1 and 4.
- ``split_keys`` keys per split-K chunk for decode: the largest power of two in [256, 8192]
  such that one chunk's K and V per SM fit in that SM's share of L2; a decode batch with fewer
  (sequence, KV head) programs than SMs is split into chunks of this size.

The chosen tiles are logged once per shape and returned by :func:`get_tuning`; they can be
overridden with ``PAGEDLLM_ATTENTION_TILES="block_m=32,block_n=64"`` (resolved once: into the
engine's KernelConfig by create_engine_config, which the runner hands its attention backend;
for the flash-attn functions once per process, :func:`env_tiles`) or by passing fields to
:func:`get_tuning`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

_KIB = 1024


@dataclass(frozen=True)
class CacheInfo:
    l1_bytes: int  # per-core L1 data cache (CPU) / 0 on CUDA
    l2_bytes: int  # per-core L2 (CPU) / whole-chip L2 (CUDA)
    shared_mem_bytes: int  # CUDA: opt-in shared memory per block; 0 on CPU
    num_units: int  # CPU threads used / CUDA streaming multiprocessors


@dataclass(frozen=True)
class AttentionTuning:
    device: str  # "cpu" or "cuda"
    block_m: int  # CPU: query tokens per tile; CUDA: rows (tokens x group heads) per program
    block_n: int  # keys per tile
    num_stages: int  # key tiles in flight (software pipelining depth)
    split_keys: int  # keys per split-K chunk for decode (0: never split)
    caches: CacheInfo
    source: str  # "rule", or what overrode it: "env", "arg"

    def describe(self) -> str:
        c = self.caches
        return (
            f"attention tiles on {self.device} (L1d {c.l1_bytes // _KIB} KiB, "
            f"L2 {c.l2_bytes // _KIB} KiB, smem {c.shared_mem_bytes // _KIB} KiB, "
            f"{c.num_units} units): block_m={self.block_m} block_n={self.block_n} "
            f"num_stages={self.num_stages} split_keys={self.split_keys} ({self.source})"
        )


def _pow2_floor(x: float, lo: int, hi: int) -> int:
    value = lo
    while value * 2 <= min(x, hi):
        value *= 2
    return value


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": _KIB, "M": _KIB * _KIB, "G": _KIB**3}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def cpu_caches() -> CacheInfo:
    """L1d / L2 of cpu0 as the OS reports them (sysfs, then sysconf, then common sizes)."""
    sizes: dict[str, int] = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            sizes.setdefault(f"L{level}", size)
    for name, key in (("L1", "SC_LEVEL1_DCACHE_SIZE"), ("L2", "SC_LEVEL2_CACHE_SIZE")):
        if name not in sizes and key in os.sysconf_names:
            value = os.sysconf(key)
            if value > 0:
                sizes[name] = value
    return CacheInfo(
        l1_bytes=sizes.get("L1", 32 * _KIB),
        l2_bytes=sizes.get("L2", 512 * _KIB),
        shared_mem_bytes=0,
        num_units=torch.get_num_threads(),
    )


def cuda_caches(device: torch.device) -> CacheInfo:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * _KIB
    return CacheInfo(
        l1_bytes=0,
        l2_bytes=getattr(props, "L2_cache_size", 0) or 4 * _KIB * _KIB,
        shared_mem_bytes=smem,
        num_units=props.multi_processor_count,
    )


def cpu_rule(caches: CacheInfo, head_dim: int, group: int) -> dict[str, int]:
    block_n = _pow2_floor(caches.l1_bytes / (2 * head_dim * 4), 16, 256)
    block_m = _pow2_floor(caches.l2_bytes / 4 / (2 * group * head_dim * 4), 16, 128)
    return dict(block_m=block_m, block_n=block_n, num_stages=2, split_keys=0)


def cuda_rule(caches: CacheInfo, head_dim: int, elem_size: int) -> dict[str, int]:
    block_m = 128 if caches.shared_mem_bytes >= 128 * _KIB and head_dim <= 128 else 64
    block_n = 64 if head_dim <= 128 else 32
    q_tile = block_m * head_dim * elem_size
    kv_tile = 2 * block_n * head_dim * elem_size
    num_stages = max(1, min(4, (caches.shared_mem_bytes - q_tile) // kv_tile))
    per_sm = caches.l2_bytes / max(1, caches.num_units)
    split_keys = _pow2_floor(per_sm / (2 * head_dim * elem_size), 256, 8192)
    return dict(block_m=block_m, block_n=block_n, num_stages=num_stages, split_keys=split_keys)


def parse_overrides(text: str | None) -> dict[str, int]:
    """ "block_m=32,block_n=64" -> {"block_m": 32, "block_n": 64}; unknown names are errors."""
    if not text:
        return {}
    fields = {"block_m", "block_n", "num_stages", "split_keys"}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().isdigit():
            raise ValueError(f"PAGEDLLM_ATTENTION_TILES: bad entry {part!r}; fields: {fields}")
        out[name] = int(value)
    return out


@functools.lru_cache(maxsize=64)
def _tuning(
    device_type: str, index: int | None, head_dim: int, group: int, elem_size: int, env: str | None
) -> AttentionTuning:
    if device_type == "cuda":
        caches = cuda_caches(torch.device("cuda", index))
        tiles = cuda_rule(caches, head_dim, elem_size)
    else:
        caches = cpu_caches()
        tiles = cpu_rule(caches, head_dim, group)
    overrides = parse_overrides(env)
    tiles.update(overrides)
    tuning = AttentionTuning(
        device_type, caches=caches, source="env" if overrides else "rule", **tiles
    )
    logger.info("%s (head_dim %d, group %d)", tuning.describe(), head_dim, group)
    return tuning


@functools.cache
def env_tiles() -> str | None:
    """PAGEDLLM_ATTENTION_TILES as the flash-attn functions use it, read once per process."""
    return envs.PAGEDLLM_ATTENTION_TILES()


def get_tuning(
    device: torch.device | str = "cpu",
    head_dim: int = 128,
    group: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    tiles: str | None = None,
    **overrides: int,
) -> AttentionTuning:
    """The tiles the kernels use for this shape on this device: the rule, then ``tiles``
    ("block_m=32,block_n=64", the PAGEDLLM_ATTENTION_TILES format), then fields in overrides."""
    device = torch.device(device)
    elem = torch.empty(0, dtype=dtype).element_size()
    tuning = _tuning(device.type, device.index, head_dim, group, elem, tiles)
    if overrides:
        tuning = dataclasses.replace(tuning, source="arg", **overrides)
    return tuning

"""The attention backend interface, the varlen kernel signature, and the registry: the one
place that picks an attention implementation, by name (the engine's attention_backend) or by
what a call needs (the flash-attn functions, :func:`select_kernel`)."""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata, VarlenBatch
from pagedllm.attention.tuning import AttentionTuning, get_tuning

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedAttentionCall:
    """One layer's attention inputs for a step, after this step's K/V went into the cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's keys
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # same shape
    scale: float
    window_left: int  # keys at most this many positions back; -1 for no limit


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V at their slots (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class VarlenKernel(Protocol):
    """Attention of a varlen batch in one call: every implementation has this signature
    (the torch reference adds keyword-only dropout_p, softcap and alibi_slopes)."""

    def __call__(
        self,
        query: torch.Tensor,  # [total_q, heads, head_dim]
        key: torch.Tensor,  # [total_k, kv_heads, head_dim] or paged [blocks, block_size, ...]
        value: torch.Tensor,  # like key
        batch: VarlenBatch,  # lengths; block_table for paged K/V
        scale: float,
        window_left: int,  # keys at most this many positions back; -1: no limit
        window_right: int,  # and ahead (0: causal); -1: no limit
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # out like query, lse [heads, total_q] fp32
        ...


class AttentionBackend(ABC):
    """Computes paged attention for a flat varlen batch (prefill, chunks and decode alike).

    ``forward`` is the same for every backend: write the new K/V through the slot mapping,
    then ``attend``; a backend implements ``attend`` and may hand a call it cannot run to
    another backend (``delegate``).
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's keys
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # same shape
        metadata: AttentionMetadata,
        scale: float,
        window_left: int,  # keys at most this many positions back; -1 for no limit
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into the cache through slot_mapping, then attend causally."""
        other = self.delegate(query, key_cache)
        if other is not None:
            return other.forward(
                query, key, value, key_cache, value_cache, metadata, scale, window_left
            )
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        call = PagedAttentionCall(query, key, value, key_cache, value_cache, scale, window_left)
        return self.attend(call, metadata)

    @classmethod
    def supports(cls, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether this backend's kernel is available and takes these inputs."""
        return True

    def delegate(self, query: torch.Tensor, key_cache: torch.Tensor) -> AttentionBackend | None:
        """Another backend to run this call instead (inputs this one does not support)."""
        return None

    def cpu_kernel_tiles(
        self, dtype: torch.dtype, num_heads: int, key_cache: torch.Tensor
    ) -> tuple[int, int] | None:
        """(block_m, block_n) when ``forward`` of num_heads query heads in dtype over this
        paged cache is the cache write plus one call of the C++ CPU kernel with these tiles
        (what the fused CPU decoder layers replay); None otherwise."""
        return None

    @abstractmethod
    def attend(
        self, call: PagedAttentionCall, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of the step's queries over the cache (already holding its K/V)."""


class VarlenKernelBackend(AttentionBackend):
    """A backend whose ``attend`` is one call of its :class:`VarlenKernel`, reading K/V
    through the block table."""

    kernel: VarlenKernel
    tuned = True  # the kernel takes tiles (``tuning=``, attention/tuning.py)

    def __init__(self, tiles: str | None = None) -> None:
        self.tiles = tiles  # tile overrides (KernelConfig.attention_tiles); None: the rule

    def tuning(self, query: torch.Tensor, key_cache: torch.Tensor) -> AttentionTuning:
        heads, head_dim = query.shape[-2:]
        group = heads // key_cache.shape[-2]
        return get_tuning(query.device, head_dim, group, query.dtype, self.tiles)

    def attend(self, call: PagedAttentionCall, metadata: AttentionMetadata) -> torch.Tensor:
        extra = {"tuning": self.tuning(call.query, call.key_cache)} if self.tuned else {}
        out, _ = self.kernel(
            call.query, call.key_cache, call.value_cache, metadata.batch, call.scale,
            call.window_left, 0, **extra,
        )  # fmt: skip
        return out


# name -> "module:Class", imported only when chosen (Triton never loads on a CPU install).
_REGISTRY: dict[str, str] = {
    "torch": "pagedllm.attention.torch_backend:TorchAttentionBackend",
    "cpu": "pagedllm.attention.cpu_backend:CpuAttentionBackend",
    "triton": "pagedllm.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def default_backend_name(device: torch.device) -> str:
    if device.type == "cuda" and "triton" in _REGISTRY:
        return "triton"
    if device.type == "cpu" and "cpu" in _REGISTRY:
        return "cpu"
    return "torch"


def backend_class(name: str) -> type[VarlenKernelBackend]:
    """The registered class (imported now; ImportError when its dependency is missing)."""
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {available_backends()}, got {name!r}.")
    module_name, cls_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def get_attention_backend(
    name: str | None, device: torch.device, tiles: str | None = None
) -> AttentionBackend:
    """The backend named (None: the device's default), with tile overrides ``tiles``."""
    name = name or default_backend_name(device)
    backend = backend_class(name)(tiles)
    logger.info("attention backend: %s", name)
    return backend


def select_kernel(
    query: torch.Tensor, key: torch.Tensor, reference: bool = False
) -> tuple[str, VarlenKernel]:
    """(name, kernel) for one call: the device's default backend when it takes the inputs,
    else (or when the call needs what only it has: ``reference``) the torch reference."""
    names = ["torch"] if reference else [default_backend_name(query.device), "torch"]
    for name in names:
        try:
            cls = backend_class(name)
        except ImportError:  # e.g. triton not installed
            continue
        if cls.supports(query, key):
            return name, cls.kernel
    raise AssertionError("the torch backend takes every input")

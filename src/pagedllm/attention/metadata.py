"""What every attention backend receives for one forward pass of a flat varlen batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class VarlenBatch:
    """Where the queries and keys of a varlen batch live: what every attention kernel takes.

    K/V are either contiguous ([total_k, kv_heads, head_dim], sequence i at rows
    cu_seqlens_k[i]:cu_seqlens_k[i] + seq_lens_k[i]) or paged ([num_blocks, block_size,
    kv_heads, head_dim], key j of sequence i in slot j % block_size of block
    block_table[i, j // block_size]). Queries sit at the end of their keys (bottom-right).
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32
    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32 when K/V are contiguous
    block_table: torch.Tensor | None  # [B, max_blocks] int32 when K/V are paged
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_k.shape[0])


@dataclass
class AttentionMetadata:
    """One step's tokens over the paged KV cache: the paged varlen batch plus where to write.

    The batch is flat: sequence i owns query tokens [cu_seqlens_q[i], cu_seqlens_q[i+1]) at
    positions [seq_lens_k[i] - query_len_i, seq_lens_k[i]); its keys are the first
    seq_lens_k[i] slots named by block_table[i] (the new tokens' K/V are written there first).
    """

    batch: VarlenBatch  # paged: block_table set ([num_seqs, max_blocks], padded with 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    query_lens_cpu: list[int]  # host copies, for per-sequence loops without a sync
    seq_lens_cpu: list[int]
    # KV cache groups 1.. (layers of another window, their own block pool): the same batch
    # with their block tables and slot mappings; empty for single-group models.
    groups: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group `group` attends with."""
        return self if group == 0 else self.groups[group - 1]

    @staticmethod
    def paged(
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence incl. this step's
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        slot_mapping: torch.Tensor,
        query_lens_cpu: list[int],
        seq_lens_cpu: list[int],
    ) -> AttentionMetadata:
        batch = VarlenBatch(
            cu_seqlens_q=query_start_loc,
            seq_lens_k=seq_lens,
            cu_seqlens_k=None,
            block_table=block_tables,
            max_seqlen_q=max(query_lens_cpu),
            max_seqlen_k=max(seq_lens_cpu),
        )
        return AttentionMetadata(batch, slot_mapping, query_lens_cpu, seq_lens_cpu)

    @property
    def block_table(self) -> torch.Tensor:
        assert self.batch.block_table is not None, "paged metadata has a block table"
        return self.batch.block_table

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.batch.max_seqlen_q == 1

    def slice(self, s0: int, s1: int, t0: int, t1: int) -> AttentionMetadata:
        """Sequences [s0, s1), which own tokens [t0, t1) of the flat batch, rebased to 0."""
        sliced = AttentionMetadata.paged(
            query_start_loc=self.batch.cu_seqlens_q[s0 : s1 + 1] - t0,
            seq_lens=self.batch.seq_lens_k[s0:s1],
            block_tables=self.block_table[s0:s1],
            slot_mapping=self.slot_mapping[t0:t1],
            query_lens_cpu=self.query_lens_cpu[s0:s1],
            seq_lens_cpu=self.seq_lens_cpu[s0:s1],
        )
        sliced.groups = tuple(g.slice(s0, s1, t0, t1) for g in self.groups)
        return sliced

    def map_tensors(self, fn: Callable[[Any], Any]) -> AttentionMetadata:
        """The same metadata with fn applied to every tensor (moving it between devices)."""
        batch = dataclasses.replace(
            self.batch,
            **{
                f.name: fn(getattr(self.batch, f.name))
                for f in dataclasses.fields(VarlenBatch)
                if getattr(self.batch, f.name) is not None
                and not isinstance(getattr(self.batch, f.name), int)
            },
        )
        groups = tuple(g.map_tensors(fn) for g in self.groups)
        return dataclasses.replace(
            self, batch=batch, slot_mapping=fn(self.slot_mapping), groups=groups
        )


# The metadata of the forward pass in flight: one of the two pieces of global state. A
# ContextVar, so that each thread (an engine's own loop) and each asyncio task sees its own.
_CURRENT: ContextVar[AttentionMetadata | None] = ContextVar("attention_metadata", default=None)


def decoding_step() -> bool:
    """Whether the forward in flight runs one token of each sequence (False outside one)."""
    metadata = _CURRENT.get()
    return metadata is not None and metadata.is_decode_only


class ForwardContext:
    """``with ForwardContext(metadata):`` makes metadata the current forward's; never nested."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self._token: Token[AttentionMetadata | None] | None = None

    def __enter__(self) -> AttentionMetadata:
        if _CURRENT.get() is not None:
            raise RuntimeError("forward contexts do not nest")
        self._token = _CURRENT.set(self.metadata)
        return self.metadata

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _CURRENT.reset(self._token)
        self._token = None

    @staticmethod
    def get() -> AttentionMetadata:
        metadata = _CURRENT.get()
        if metadata is None:
            raise RuntimeError("attention called outside a forward context")
        return metadata

"""What every attention backend receives for one forward pass of a flat varlen batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's tokens over the paged KV cache.

    The batch is flat: sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1])
    at positions [seq_lens[i] - query_len_i, seq_lens[i]); its keys are the first seq_lens[i]
    slots named by block_tables[i] (the new tokens' K/V are written there first).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens_q
    seq_lens: torch.Tensor  # [num_seqs] int32, keys per sequence incl. this step's
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    query_lens_cpu: list[int]  # host copies, for per-sequence loops without a sync
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class ForwardContext:
    """The attention metadata of the forward pass in flight (the one global, by design)."""

    _current: AttentionMetadata | None = None

    def __init__(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata

    def __enter__(self) -> AttentionMetadata:
        if ForwardContext._current is not None:
            raise RuntimeError("forward contexts do not nest")
        ForwardContext._current = self.metadata
        return self.metadata

    def __exit__(self, *exc: object) -> None:
        ForwardContext._current = None

    @staticmethod
    def get() -> AttentionMetadata:
        if ForwardContext._current is None:
            raise RuntimeError("attention called outside a forward context")
        return ForwardContext._current


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

    @staticmethod
    def from_metadata(metadata: AttentionMetadata) -> VarlenBatch:
        return VarlenBatch(
            cu_seqlens_q=metadata.query_start_loc,
            seq_lens_k=metadata.seq_lens,
            cu_seqlens_k=None,
            block_table=metadata.block_tables,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
        )

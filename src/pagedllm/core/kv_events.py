"""KV-cache events: what the prefix cache gained and lost, as plain data (torch-free, no I/O).

The block manager records an event when full blocks become cached under their hashes
(``BlockStored``), when a cached block is evicted for reuse (``BlockRemoved``) and when the
whole cache is forgotten (``AllBlocksCleared``). The events mean what vLLM's
``vllm.distributed.kv_events`` mean, so a prefix-aware router that follows a vLLM replica's
cache can follow a pagedllm one; putting them on the wire is metrics/kv_events.py's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class BlockStored:
    """Consecutive blocks of one sequence that became cached, in prefix order."""

    block_hashes: list[int]  # each block's chained hash
    parent_block_hash: int | None  # the hash of the block before the first; None at the start
    token_ids: list[int]  # the tokens of all the blocks, block_size per block
    block_size: int


@dataclass
class BlockRemoved:
    """Cached blocks whose hashes no longer name anything here (evicted for reuse)."""

    block_hashes: list[int]


@dataclass
class AllBlocksCleared:
    """The prefix cache was forgotten as a whole."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order they happened, until ``take`` hands them over (once per step).

    Consecutive evictions merge into one ``BlockRemoved``, as they happen in bursts when a
    step allocates many blocks.
    """

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        indexes: Sequence[int],
        block_size: int,
    ) -> None:
        """Blocks ``indexes`` (ascending) of a sequence with these hashes and tokens became
        cached: one BlockStored per run of consecutive indexes (usually a single run)."""
        start = 0
        for k in range(1, len(indexes) + 1):
            if k < len(indexes) and indexes[k] == indexes[k - 1] + 1:
                continue
            first, last = indexes[start], indexes[k - 1]
            parent = block_hashes[first - 1] if first else None
            tokens = list(token_ids[first * block_size : (last + 1) * block_size])
            hashes = list(block_hashes[first : last + 1])
            self._events.append(BlockStored(hashes, parent, tokens, block_size))
            start = k

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)

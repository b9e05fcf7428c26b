"""KV cache groups: one block manager per group of attention layers that share a window
(torch-free).

A model that mixes global and sliding-window layers (Gemma 3: five local layers to one
global) keeps one block pool per group. Every sequence has a block table per group: the
global group's tables hold every block, the sliding group's release the blocks that left
its window (core/block_manager.py). All groups share one hash chain of the tokens
(``seq.block_hashes``), each caching its own blocks under it, so a prefix hit is the
longest prefix whose blocks every group still has. Allocation is all groups or none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pagedllm.core.block_manager import Block, BlockManager
from pagedllm.core.kv_cache import KVCacheGroup
from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.sequence import Sequence

CachedBlocks = tuple[Block, ...]  # one block per group at the same block index


class GroupedBlockManager:
    """The BlockManager interface the scheduler uses, over one manager per KV cache group.

    A cached prefix is returned as a list of per-index tuples (one block per group), so its
    length is still the number of blocks hit. KV-cache events come from group 0 (the global
    layers), whose blocks name every prefix the engine can still serve.
    """

    def __init__(
        self, groups: Seq[KVCacheGroup], block_size: int, enable_prefix_caching: bool
    ) -> None:
        if len(groups) < 2:
            raise ValueError("a grouped block manager needs at least two KV cache groups.")
        self.groups = [
            BlockManager(g.num_blocks, block_size, enable_prefix_caching, g.window_left, group=i)
            for i, g in enumerate(groups)
        ]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window_left = None  # no window shared by every layer
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks of group 0 (the global layers): what bounds a sequence's length."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def usage(self) -> float:
        """The fullest group's usage: the one that runs out first."""
        return max(g.usage for g in self.groups)

    @property
    def num_released_blocks(self) -> int:
        return sum(g.num_released_blocks for g in self.groups)

    @property
    def hash_to_block(self) -> dict[int, Block]:
        return self.groups[0].hash_to_block

    @property
    def events(self) -> KVEventLog | None:
        return self.groups[0].events

    @events.setter
    def events(self, log: KVEventLog | None) -> None:
        self.groups[0].events = log

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].blocks_needed(num_tokens)

    def can_ever_hold(self, num_tokens: int, max_step_tokens: int) -> bool:
        return all(g.can_ever_hold(num_tokens, max_step_tokens) for g in self.groups)

    # ---- prefix cache --------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        self.groups[0].update_block_hashes(seq)

    def find_cached_blocks(self, seq: Sequence) -> list[CachedBlocks]:
        """The longest prefix hit valid in every group. A sliding group's valid hits are not
        closed under shortening (a shorter hit's window may reach evicted blocks), so each
        group is asked again with the common length until they all agree."""
        if not self.enable_prefix_caching:
            return []
        limit: int | None = None
        found = [g.find_cached_blocks(seq, limit) for g in self.groups]
        while len({len(f) for f in found}) > 1:
            limit = min(len(f) for f in found)
            found = [g.find_cached_blocks(seq, limit) for g in self.groups]
        return list(zip(*found))

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        for g in self.groups:
            g.cache_full_blocks(seq)

    # ---- allocation ----------------------------------------------------------------------
    def _split(self, cached: Seq[CachedBlocks]) -> list[list[Block]]:
        return [[blocks[i] for blocks in cached] for i in range(len(self.groups))]

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[CachedBlocks] = ()
    ) -> bool:
        per_group = self._split(cached)
        return all(g.can_allocate(seq, num_new_tokens, c) for g, c in zip(self.groups, per_group))

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[CachedBlocks] = ()) -> bool:
        """Blocks in every group, or (returning False) in none."""
        if not self.can_allocate(seq, num_new_tokens, cached):
            return False
        for g, c in zip(self.groups, self._split(cached)):
            assert g.allocate(seq, num_new_tokens, c)
        return True

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)

    def release_outside_window(self, seq: Sequence) -> int:
        return sum(g.release_outside_window(seq) for g in self.groups)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(seq, num_tokens)

    def reset_prefix_cache(self) -> bool:
        if any(g.num_free_blocks != g.num_blocks for g in self.groups):
            return False
        for g in self.groups:
            g.reset_prefix_cache()
        return True

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, live: Seq[Sequence] | None = None) -> None:
        for g in self.groups:
            g.check_integrity(live)
        if live is not None:
            for seq in live:  # every group's table covers the same positions
                lengths = {len(g.table(seq)) for g in self.groups}
                assert len(lengths) == 1, f"sequence {seq.seq_id}: group tables {lengths}"

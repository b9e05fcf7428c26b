"""Block-level KV cache allocator with automatic prefix caching (torch-free).

Every KV block holds ``block_size`` token slots. A block that is full and whose tokens are
computed gets a hash chained from its predecessor's, ``hash((parent_hash, tokens))``, so a
block's hash names the whole prefix up to its end. ``hash_to_block`` maps such hashes to
blocks; a new request walks its prompt's chain and reuses every block that is found.

Free blocks sit in a doubly linked LRU queue. A freed block keeps its hash (it may be hit
again) and is evicted lazily, only when it is popped for reuse. A hit on a free block takes
it out of the queue in O(1). Sequences free their blocks tail first, so the tail of a
prefix, the part least likely to be shared, is evicted first.

With ``events`` set (a KVEventLog), every change of the hash index is recorded for a
prefix-aware router: blocks cached, evicted, all forgotten.

Sliding windows: when every attention layer looks back at most ``window_left`` keys
(Mistral-style), a block wholly before the oldest key any future query of its sequence can
see is released as soon as its sequence moves past it (``release_outside_window``). Its
block-table entry then names the reserved null block (block 0, never allocated, never
written), which the attention kernels never read for such positions, or read only under
the window's mask. A released block keeps its hash in the free queue like any freed block,
and a prefix hit needs only the cached blocks the window reaches (``find_cached_blocks``),
so a prompt whose oldest blocks were evicted still hits its recent ones.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedllm.core.kv_events import KVEventLog
from pagedllm.core.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full, computed and cached
    token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash (hits re-check)
    prev: Block | None = None  # free-queue links; both None when not in the queue
    next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft is the least recently freed."""

    def __init__(self, blocks: Seq[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self.num_free += 1

    def popleft(self) -> Block:
        block = self._head.next
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, "block is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    """Owns the KV blocks: allocation, ref counts, prefix-cache lookups and eviction."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window_left: int | None = None,
        group: int = 0,
    ) -> None:
        """window_left: keys every layer's queries look back at most (flash-attn's
        window_size[0]), or None when some layer sees the whole sequence; with it set,
        block 0 is the null block and blocks outside the window are released. group: the
        KV cache group whose block table of each sequence this manager owns (0:
        ``seq.block_table``, g > 0: ``seq.group_block_tables[g - 1]``)."""
        if window_left is not None and window_left < 0:
            raise ValueError(f"window_left must be >= 0 or None, got {window_left}.")
        reserved = 1 if window_left is not None else 0
        if num_blocks - reserved <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks - reserved}.")
        self.block_size = block_size
        self.group = group
        self.enable_prefix_caching = enable_prefix_caching
        self.window_left = window_left
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The null block: entries of released blocks point here; it is never handed out.
        self.null_block_id: int | None = 0 if reserved else None
        self.num_blocks = num_blocks - reserved  # blocks a sequence can get
        self.free_queue = FreeBlockQueue(self.blocks[reserved:])
        self.num_released_blocks = 0  # cumulative: blocks released for leaving the window
        self.hash_to_block: dict[int, Block] = {}
        # seq_id -> the blocks of its table that cache_full_blocks has registered or passed
        # over: each step looks at the blocks filled since, not the whole table again
        self._blocks_seen: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # of which found in the cache
        self.events: KVEventLog | None = None  # set to record KV-cache events

    # ---- queries -------------------------------------------------------------------------
    def table(self, seq: Sequence) -> list[int]:
        """seq's block table in this manager's group."""
        if self.group == 0:
            return seq.block_table
        tables = seq.group_block_tables
        while len(tables) < self.group:
            tables.append([])
        return tables[self.group - 1]

    def _set_table(self, seq: Sequence, table: list[int]) -> None:
        if self.group == 0:
            seq.block_table = table
        else:
            self.table(seq)
            seq.group_block_tables[self.group - 1] = table

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of up to num_tokens computed tokens holds at once,
        when a step computes at most max_step_tokens: all of them without a window; with one,
        the blocks of a step's keys (its tokens and the window before them), plus one for a
        window that starts inside a block."""
        full = self.blocks_needed(num_tokens)
        if self.window_left is None:
            return full
        return min(full, self.blocks_needed(self.window_left + max_step_tokens) + 1)

    def can_ever_hold(self, num_tokens: int, max_step_tokens: int) -> bool:
        """Whether one sequence of up to num_tokens computed tokens fits the pool alone."""
        return self.max_blocks_held(num_tokens, max_step_tokens) <= self.num_blocks

    def first_live_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a sequence still needs once num_computed_tokens are
        computed: the next query (at position num_computed_tokens) sees keys from
        num_computed_tokens - window_left on, and so does every later one."""
        if self.window_left is None:
            return 0
        return max(0, num_computed_tokens - self.window_left) // self.block_size

    # ---- prefix cache --------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes over every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        # An adapter's K/V differ from the base model's: its chain starts from its own root.
        root = None if seq.lora_int_id == 0 else hash(("lora", seq.lora_int_id))
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))

    def find_cached_blocks(self, seq: Sequence, limit: int | None = None) -> list[Block]:
        """The longest cached prefix of seq, leaving >= 1 token to compute, as the blocks to
        put in its block table. Without a window every block of the prefix must be cached;
        with one only those the window reaches from the prefix's end, and the entries before
        them are the null block. limit: at most this many blocks (a hit every group has)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # the last token must be computed for logits
        if limit is not None:
            max_blocks = min(max_blocks, limit)
        found: list[Block | None] = []
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            block = self.hash_to_block.get(block_hash)
            if block is None or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                if self.window_left is None:
                    break
                block = None  # a window may not need it: keep looking
            found.append(block)
        if self.window_left is None:
            return [b for b in found if b is not None]
        return self._window_hit(found)

    def _window_hit(self, found: list[Block | None]) -> list[Block]:
        """The longest hit of num_hit blocks whose live blocks (those the window reaches from
        token num_hit * block_size on) are all cached; the null block before them. A chain
        hash names the whole prefix, so a cached block vouches for the tokens before it."""
        assert self.null_block_id is not None
        run = 0  # cached blocks ending at index i
        best = 0
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            num_hit = i + 1
            if num_hit - self.first_live_block(num_hit * self.block_size) <= run:
                best = num_hit
        first = self.first_live_block(best * self.block_size)
        null = self.blocks[self.null_block_id]
        return [null] * first + [b for b in found[first:best] if b is not None]

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are now full and computed under their hashes."""
        if not self.enable_prefix_caching:
            return
        table = self.table(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        seen = self._blocks_seen.get(seq.seq_id, 0)
        if num_full <= seen:
            return
        self._blocks_seen[seq.seq_id] = num_full
        self.update_block_hashes(seq)
        stored: list[int] = []  # indexes of the blocks cached by this call, for events
        for i in range(seen, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is not None or block.block_id == self.null_block_id:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self.hash_to_block:
                continue  # computed twice concurrently; keep the first copy
            bs = self.block_size
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.hash_to_block[block_hash] = block
            stored.append(i)
        if stored and self.events is not None:
            self.events.stored(seq.block_hashes, seq.token_ids, stored, self.block_size)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[Block] = ()) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        new = max(0, needed - len(self.table(seq)) - len(cached))
        # Cached blocks that are free now stop counting as free once they are taken.
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0 and b.block_id != self.null_block_id)
        return new + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[Block] = ()) -> bool:
        """Give seq blocks for num_new_tokens more tokens, reusing cached ones first.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        if not self.can_allocate(seq, num_new_tokens, cached):
            return False
        table = self.table(seq)
        for block in cached:
            if block.block_id != self.null_block_id:
                self._touch(block)
            table.append(block.block_id)
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(table) < needed:
            block = self._pop_free()
            block.ref_cnt = 1
            table.append(block.block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first, so tails are evicted before shared heads."""
        for block_id in reversed(self.table(seq)):
            if block_id != self.null_block_id:
                self._release(self.blocks[block_id])
        self._set_table(seq, [])
        self._blocks_seen.pop(seq.seq_id, None)

    def release_outside_window(self, seq: Sequence) -> int:
        """Release seq's blocks that lie wholly before the oldest key any of its future
        queries sees, oldest first (they are the first to be evicted; a later prefix hit
        needs only the recent ones). Their entries become the null block, so block indexes
        still follow positions. Returns how many were released."""
        if self.null_block_id is None:
            return 0
        table = self.table(seq)
        # Entries before an earlier release are null already: walk back to the first one.
        start = end = min(self.first_live_block(seq.num_computed_tokens), len(table))
        while start > 0 and table[start - 1] != self.null_block_id:
            start -= 1
        for i in range(start, end):
            self._release(self.blocks[table[i]])
            table[i] = self.null_block_id
        self.num_released_blocks += end - start
        return end - start

    def _release(self, block: Block) -> None:
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
        if block.ref_cnt == 0:
            self.free_queue.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past the first num_tokens tokens, tail first: the slots of
        rejected speculative tokens. Such blocks never held computed tokens only, so they carry
        no hash and the prefix cache never sees their contents."""
        keep = self.blocks_needed(num_tokens)
        table = self.table(seq)
        while len(table) > keep:
            block = self.blocks[table.pop()]
            assert block.block_hash is None, f"trimmed block {block.block_id} is cached"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _touch(self, block: Block) -> None:
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _pop_free(self) -> Block:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # lazy eviction
            if self.hash_to_block.get(block.block_hash) is block:
                del self.hash_to_block[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = block.token_ids = None
        return block

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, live: Seq[Sequence] | None = None) -> None:
        """Assert the allocator's invariants; with live sequences, also that refs add up."""
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free count out of sync"
        assert len({b.block_id for b in free}) == len(free), "block twice in the free queue"
        for block in self.blocks:
            in_queue = block.prev is not None
            if block.block_id == self.null_block_id:
                assert not in_queue and block.ref_cnt == 0, "the null block was handed out"
                assert block.block_hash is None, "the null block is cached"
                continue
            assert in_queue == (block.ref_cnt == 0), f"block {block.block_id} free-state mismatch"
        for block_hash, block in self.hash_to_block.items():
            assert block.block_hash == block_hash, "hash index points at a re-used block"
        if live is not None:
            gone = set(self._blocks_seen) - {seq.seq_id for seq in live}
            assert not gone, f"cache_full_blocks still tracks freed sequences {sorted(gone)}"
            refs = [0] * len(self.blocks)
            for seq in live:
                self._check_window(seq)
                for block_id in self.table(seq):
                    refs[block_id] += 1
            for block in self.blocks:
                if block.block_id == self.null_block_id:
                    continue
                assert refs[block.block_id] == block.ref_cnt, (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, referenced "
                    f"{refs[block.block_id]} times"
                )

    def _check_window(self, seq: Sequence) -> None:
        """With a window: entries before the first live block are the null block (released,
        none kept), and no entry from it on is (attention reads those)."""
        if self.null_block_id is None:
            return
        first = self.first_live_block(seq.num_computed_tokens)
        for i, block_id in enumerate(self.table(seq)):
            is_null = block_id == self.null_block_id
            assert is_null == (i < first), (
                f"sequence {seq.seq_id}, KV group {self.group}: block-table entry {i} is "
                f"{'the null block' if is_null else f'block {block_id}'}, but the window's "
                f"first live block is {first} ({seq.num_computed_tokens} tokens computed)"
            )

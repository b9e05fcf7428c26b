"""The block manager's KV-cache events: every change of its hash index, in order, as plain
data (what a prefix-aware router is told), and nothing at all while events are off."""

from __future__ import annotations

from helpers.sequences import make_seq

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog


def manager(num_blocks: int = 4) -> BlockManager:
    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    bm.events = KVEventLog()
    return bm


def compute(bm: BlockManager, seq_id: int, prompt: list[int]):  # noqa: ANN201
    seq = make_seq(seq_id, prompt)
    cached = bm.find_cached_blocks(seq)
    seq.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_stored_blocks_carry_their_hash_chain_and_tokens() -> None:
    bm = manager()
    seq = compute(bm, 0, list(range(10)))  # two full blocks of 4, two tokens left over
    (event,) = bm.events.take()
    assert event == BlockStored(seq.block_hashes[:2], None, list(range(8)), 4)
    assert bm.events.take() == []  # taken once
    seq.append_token(10)
    seq.append_token(11)
    seq.num_computed_tokens = 12
    bm.allocate(seq, 0)
    bm.cache_full_blocks(seq)  # the third block fills: its parent is the second
    assert bm.events.take() == [
        BlockStored([seq.block_hashes[2]], seq.block_hashes[1], [8, 9, 10, 11], 4)
    ]
    bm.check_integrity([seq])


def test_a_hit_stores_nothing_and_eviction_removes_in_lru_order() -> None:
    bm = manager(num_blocks=4)
    a = compute(bm, 0, list(range(8)) + [99])  # blocks 0-1 cached, one partial
    hashes = list(a.block_hashes)
    bm.events.take()
    b = compute(bm, 1, list(range(8)) + [98])  # shares both blocks: nothing new is cached
    assert bm.events.take() == []
    bm.free(a)
    bm.free(b)
    # four new blocks take the whole cache: the shared blocks go last, tail before head
    c = compute(bm, 2, [50 + i for i in range(16)])
    events = bm.events.take()
    assert events == [
        BlockRemoved([hashes[1], hashes[0]]),
        BlockStored(c.block_hashes, None, [50 + i for i in range(16)], 4),
    ]
    assert not any(h in bm.hash_to_block for h in hashes)


def test_reset_clears_and_off_means_no_log() -> None:
    bm = manager()
    seq = compute(bm, 0, list(range(9)))
    bm.free(seq)
    bm.events.take()
    assert bm.reset_prefix_cache()
    assert bm.events.take() == [AllBlocksCleared()]
    quiet = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    compute(quiet, 0, list(range(9)))
    assert quiet.events is None  # nothing is recorded, nothing grows


def test_log_groups_runs_and_merges_removals() -> None:
    log = KVEventLog()
    hashes, tokens = [10, 11, 12, 13], list(range(8))
    log.stored(hashes, tokens, [0, 1, 3], 2)  # block 2 was cached already: two runs
    log.removed(5)
    log.removed(6)
    assert log.take() == [
        BlockStored([10, 11], None, [0, 1, 2, 3], 2),
        BlockStored([13], 12, [6, 7], 2),
        BlockRemoved([5, 6]),
    ]

"""Sliding-window block release: blocks before every layer's window go back to the pool,
their entries name the null block, and prefix hits need only the window's blocks."""

from __future__ import annotations

import pytest
from helpers.sequences import make_seq

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_cache import shared_window_left
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence

BS = 4
WINDOW_LEFT = 7  # a window of 8 keys: the query and the 7 before it


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """One step of num_new tokens as the scheduler runs it: allocate, compute, cache, release."""
    assert bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)
    bm.release_outside_window(seq)


def test_blocks_before_the_window_are_released_and_null():
    bm = BlockManager(32, BS, enable_prefix_caching=True, window_left=WINDOW_LEFT)
    assert bm.num_free_blocks == 31  # block 0 is the null block, never handed out
    seq = make_seq(0, list(range(40)))
    for _ in range(5):  # chunks of 8
        compute(bm, seq, 8)
        bm.check_integrity([seq])
    # the next query is at 40 and sees keys 33..40: blocks 0-7 (tokens 0..31) are released
    first = bm.first_live_block(40)
    assert first == 8
    assert seq.block_table[:first] == [bm.null_block_id] * first
    assert bm.null_block_id not in seq.block_table[first:]
    assert bm.num_released_blocks == 8
    assert bm.num_free_blocks == 31 - (len(seq.block_table) - first)
    # the released blocks keep their hashes: they are cached, free and evictable
    cached_free = [b for b in bm.free_queue if b.block_hash is not None]
    assert len(cached_free) == 8


def test_decode_holds_at_most_the_window_blocks():
    bm = BlockManager(32, BS, enable_prefix_caching=False, window_left=WINDOW_LEFT)
    seq = make_seq(0, list(range(5)))
    compute(bm, seq, 5)
    held = []
    for token in range(60):
        seq.append_token(token)
        compute(bm, seq, 1)
        held.append(sum(b != bm.null_block_id for b in seq.block_table))
        bm.check_integrity([seq])
    # ceil(window / block) + 1 blocks cover any window, wherever it starts in a block
    assert max(held) <= -(-(WINDOW_LEFT + 1) // BS) + 1
    assert bm.max_blocks_held(65, 1) == bm.blocks_needed(WINDOW_LEFT + 1) + 1
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])


def test_prefix_hit_after_the_oldest_released_blocks_were_evicted():
    bm = BlockManager(14, BS, enable_prefix_caching=True, window_left=WINDOW_LEFT)
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks
    a = make_seq(0, prompt)
    for _ in range(4):
        compute(bm, a, 8)
    compute(bm, a, 1)
    bm.free(a)
    # A stranger takes 7 free blocks: the 4 never used, then the least recently freed,
    # a's oldest three (released first, as the window passed them).
    stranger = make_seq(1, list(range(500, 528)))
    compute(bm, stranger, 28)
    assert not any(h in bm.hash_to_block for h in a.block_hashes[:3])
    assert all(h in bm.hash_to_block for h in a.block_hashes[3:8])
    b = make_seq(2, prompt)
    hits = bm.find_cached_blocks(b)
    # 8 blocks are hit (all but the last token's); a query at 32 needs keys 25.., blocks 6-7
    assert len(hits) == 8
    assert [h.block_id for h in hits[:6]] == [bm.null_block_id] * 6
    assert [h.block_hash for h in hits[6:]] == a.block_hashes[6:8]
    b.num_computed_tokens = 32
    assert bm.allocate(b, 1, hits)
    bm.check_integrity([b, stranger])


def test_a_hole_inside_the_window_shortens_the_hit():
    bm = BlockManager(20, BS, enable_prefix_caching=True, window_left=WINDOW_LEFT)
    prompt = list(range(200, 233))
    a = make_seq(0, prompt)
    compute(bm, a, 32)
    # forget block 6's hash: a hit of 8 blocks needs 6 and 7, a hit of 6 needs 4 and 5
    hole = bm.blocks[a.block_table[6]]
    del bm.hash_to_block[hole.block_hash]
    hole.block_hash = hole.token_ids = None
    hits = bm.find_cached_blocks(make_seq(1, prompt))
    assert len(hits) == 6
    assert [h.block_id for h in hits[:4]] == [bm.null_block_id] * 4
    assert [h.block_hash for h in hits[4:]] == a.block_hashes[4:6]


def test_integrity_catches_a_kept_block_and_a_null_one_in_the_window():
    bm = BlockManager(32, BS, enable_prefix_caching=False, window_left=WINDOW_LEFT)
    seq = make_seq(0, list(range(24)))
    assert bm.allocate(seq, 24)
    seq.num_computed_tokens = 24  # computed, but release_outside_window not called
    with pytest.raises(AssertionError, match="first live block"):
        bm.check_integrity([seq])
    bm.release_outside_window(seq)
    bm.check_integrity([seq])
    seq.block_table[-1] = bm.null_block_id  # a live entry that names the null block
    with pytest.raises(AssertionError, match="null block"):
        bm.check_integrity([seq])


def test_scheduler_admits_what_only_fits_with_the_window():
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, max_model_len=1000, enable_chunked_prefill=True
    )
    long = make_seq(0, list(range(300)), max_tokens=50)  # 349 slots = 88 blocks
    with pytest.raises(ValueError, match="can never fit"):
        Scheduler(config, BlockManager(20, BS, True)).add(long)
    sched = Scheduler(config, BlockManager(20, BS, True, window_left=WINDOW_LEFT))
    sched.add(long)  # it holds at most ceil((7 + 8) / 4) + 1 = 5 blocks at once
    held = 0
    while not long.is_finished:
        out = sched.schedule()
        held = max(held, sum(b != 0 for b in long.block_table))
        sched.update(out, {s.seq.seq_id: [7] for s in out.scheduled if s.samples})
        sched.check_integrity()
    assert long.num_output_tokens == 50
    assert held <= 5
    assert sched.block_manager.num_released_blocks >= 80
    assert sched.num_preemptions == 0


class _Config:
    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def test_shared_window_left_reads_the_layer_rules():
    assert shared_window_left(_Config(sliding_window=4096)) == 4095
    assert shared_window_left(_Config(sliding_window=None)) is None
    assert shared_window_left(_Config(sliding_window=64, use_sliding_window=False)) is None
    every = ["sliding_attention"] * 4
    assert shared_window_left(_Config(sliding_window=16, layer_types=every)) == 15
    mixed = every + ["full_attention"]
    assert shared_window_left(_Config(sliding_window=16, layer_types=mixed)) is None
    # global layers named by a pattern or by the family: they read every block
    assert shared_window_left(_Config(sliding_window=16, sliding_window_pattern=6)) is None
    assert shared_window_left(_Config(sliding_window=16, model_type="gemma3_text")) is None

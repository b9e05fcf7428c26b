"""KV cache groups (global and sliding-window layers, a block pool each): every sequence has
a block table per group, the sliding group releases what left its window while the global
group keeps everything, a prefix hit is one that every group can serve, allocation is all
groups or none, and check_integrity covers every group."""

from __future__ import annotations

import pytest
from helpers.sequences import make_seq

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache import KVCacheGroup, split_kv_budget
from pagedllm.core.kv_groups import GroupedBlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence

BS = 4
WINDOW_LEFT = 7


def manager(global_blocks: int = 32, sliding_blocks: int = 32) -> GroupedBlockManager:
    groups = [KVCacheGroup(global_blocks, 64, None), KVCacheGroup(sliding_blocks, 128, WINDOW_LEFT)]
    return GroupedBlockManager(groups, BS, enable_prefix_caching=True)


def compute(bm: GroupedBlockManager, seq: Sequence, num_new: int) -> None:
    assert bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)
    bm.release_outside_window(seq)
    bm.check_integrity([seq])


def run_prompt(bm: GroupedBlockManager, seq: Sequence, chunk: int = 8) -> None:
    while seq.num_computed_tokens < seq.num_tokens:
        compute(bm, seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))


def test_the_sliding_group_releases_and_the_global_group_keeps_every_block():
    bm = manager()
    glob, sliding = bm.groups
    seq = make_seq(0, list(range(40)))
    run_prompt(bm, seq)
    assert glob.null_block_id is None  # the global group has no null block: all real
    assert len(set(seq.block_table)) == len(seq.block_table) == 10
    (table,) = seq.group_block_tables
    first = sliding.first_live_block(40)
    assert first == 8 and table[:first] == [sliding.null_block_id] * first
    assert glob.num_released_blocks == 0 and sliding.num_released_blocks == 8
    assert glob.num_free_blocks == 32 - 10
    assert sliding.num_free_blocks == 31 - (10 - first)  # block 0 is the null block
    bm.free(seq)
    assert seq.block_table == [] and seq.group_block_tables == [[]]
    assert bm.usage == 0.0
    bm.check_integrity([])


def test_a_prefix_hit_is_the_longest_one_every_group_serves():
    bm = manager()
    tokens = list(range(41))
    first = make_seq(0, tokens)
    run_prompt(bm, first)
    global_table = list(first.block_table)
    bm.free(first)
    again = make_seq(1, tokens)
    hit = bm.find_cached_blocks(again)
    assert len(hit) == 10  # every full block but none past the last prompt token
    assert [blocks[1].block_id for blocks in hit[:8]] == [0] * 8  # sliding: null before it
    assert [blocks[0].block_id for blocks in hit] == global_table[:10]  # global: every block
    # evict the global group's block 6: no hit may reach past block 5 now, and the sliding
    # group's hit at 6 blocks needs blocks 4 and 5 (its window from token 24 on)
    glob, sliding = bm.groups
    victim = glob.hash_to_block.pop(again.block_hashes[6])
    victim.block_hash = victim.token_ids = None
    hit = bm.find_cached_blocks(again)
    assert len(hit) == 6
    assert [blocks[1].block_id == 0 for blocks in hit] == [True] * 4 + [False] * 2
    # and with the sliding group's block 4 gone too, 6 is no hit; no shorter one is valid
    # for the window either (its window from 20 on needs block 4, from 16 on block 3 and 4
    # ... until a hit of 1 block, which needs block 0 whose copy was evicted as well)
    for i in range(0, 5):
        block = sliding.hash_to_block.pop(again.block_hashes[i], None)
        if block is not None:
            block.block_hash = block.token_ids = None
    assert bm.find_cached_blocks(again) == []
    assert bm.allocate(again, again.num_tokens)
    bm.check_integrity([again])


def test_allocation_is_all_groups_or_none():
    bm = manager(global_blocks=64, sliding_blocks=4)  # 3 sliding blocks besides the null one
    seq = make_seq(0, list(range(20)))
    assert not bm.allocate(seq, 20)  # the global group has room, the sliding one not
    assert seq.block_table == [] and bm.groups[0].num_free_blocks == 64
    assert bm.allocate(seq, 8)
    assert len(seq.block_table) == len(seq.group_block_tables[0]) == 2
    bm.check_integrity([seq])


def test_admission_and_preemption_count_both_groups():
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, max_model_len=1000, enable_chunked_prefill=True
    )
    # a window and a step reach ceil((7 + 8) / 4) + 1 = 5 blocks: 4 sliding blocks never do
    with pytest.raises(ValueError, match="can never fit"):
        Scheduler(config, manager(global_blocks=64, sliding_blocks=5)).add(make_seq(0, [1] * 30))
    # the global group holds both sequences; the sliding group (5 blocks) not both windows
    bm = manager(global_blocks=64, sliding_blocks=6)
    sched = Scheduler(config, bm)
    seqs = [make_seq(i, list(range(3, 33 + i)), max_tokens=20) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    while not all(seq.is_finished for seq in seqs):
        out = sched.schedule()
        sched.update(out, {s.seq.seq_id: [7] for s in out.scheduled if s.samples})
        sched.check_integrity()
        for seq in sched.running:
            assert sum(b != 0 for b in seq.group_block_tables[0]) <= 5
    assert all(seq.num_output_tokens == 20 for seq in seqs)
    assert sched.num_preemptions > 0
    assert bm.groups[1].num_released_blocks > 0 and bm.groups[0].num_released_blocks == 0
    assert bm.usage == 0.0


def test_the_budget_is_split_by_need():
    # a max-length sequence: 40 global blocks of 64 bytes, 7 sliding ones of 128 (+ a null)
    need, per_block, windowed = [40, 7], [64, 128], [False, True]
    per_seq = 40 * 64 + 7 * 128
    assert split_kv_budget(3 * per_seq + 128, need, per_block, windowed, 8) == [120, 22]
    # past max_num_seqs sequences, the rest keeps sliding blocks cached (up to the global count)
    assert split_kv_budget(10 * per_seq + 128, need, per_block, windowed, 2) == [80, 81]
    # below one sequence: equal counts, as one pool for both groups would hold
    assert split_kv_budget(10 * 192 + 128, need, per_block, windowed, 8) == [10, 11]

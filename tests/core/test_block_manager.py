"""Block manager invariants and prefix caching, without torch."""

from __future__ import annotations

import random
import sys

import pytest
from helpers.sequences import make_seq

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence


def test_engine_core_does_not_import_torch():
    import subprocess

    code = (
        "import sys, pagedllm.core.scheduler, pagedllm.core.block_manager;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_integrity([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    bm.check_integrity([])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    bm.check_integrity([])


def test_prefix_hit_reuses_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq(0, list(range(12)))
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = make_seq(1, list(range(12)))  # identical prompt: 2 blocks hit, last block recomputed
    hits = bm.find_cached_blocks(b)
    assert [blk.block_id for blk in hits] == a.block_table[:2]
    b.num_computed_tokens = 8
    assert bm.allocate(b, 4, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_cnt == 2
    bm.check_integrity([a, b])


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    table = list(a.block_table)
    bm.free(a)
    assert len(bm.hash_to_block) == 4  # lazily kept
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 9])
    hits = bm.find_cached_blocks(b)
    assert [h.block_id for h in hits] == table[:3]
    # a fresh sequence needing one block evicts a's tail block first (freed first)
    c = make_seq(2, [42, 43])
    assert bm.allocate(c, 2)
    assert c.block_table == [table[3]]
    assert table[3] not in {blk.block_id for blk in bm.hash_to_block.values()}
    bm.check_integrity([c])


def test_hit_rechecks_tokens_on_hash_collision(monkeypatch):
    import pagedllm.core.block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: 7)  # everything collides
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3])
    assert bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert bm.find_cached_blocks(make_seq(1, [9, 9, 9])) == []


def test_decode_looks_only_at_the_blocks_filled_since_its_last_step():
    """A decoding sequence's step looks at the blocks filled since its last one, not at its
    whole table again: each block is looked at once, when its last token is computed, and
    registered then."""

    class CountingBlocks(list):
        looked = 0

        def __getitem__(self, i):
            CountingBlocks.looked += 1
            return super().__getitem__(i)

    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    bm.blocks = CountingBlocks(bm.blocks)
    seq = make_seq(0, list(range(6)))
    assert bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    bm.cache_full_blocks(seq)
    assert len(bm.hash_to_block) == 1
    looked = []
    for token in range(100, 130):  # 30 decode steps: one token computed a step
        seq.append_token(token)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        CountingBlocks.looked = 0
        bm.cache_full_blocks(seq)
        looked.append(CountingBlocks.looked)
        assert len(bm.hash_to_block) == seq.num_computed_tokens // 4  # registered once full
        bm.check_integrity([seq])
    assert looked == [1 if (7 + i) % 4 == 0 else 0 for i in range(30)]
    bm.free(seq)
    bm.check_integrity([])  # nothing left tracked for the freed sequence
    again = make_seq(1, list(seq.token_ids))  # its blocks serve a later prompt
    assert len(bm.find_cached_blocks(again)) == (seq.num_tokens - 1) // 4


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    for step in range(400):
        if live and rng.random() < 0.4:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            seq = make_seq(step, tokens)
            hits = bm.find_cached_blocks(seq)
            seq.num_computed_tokens = len(hits) * 4
            if bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens, hits):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
        bm.check_integrity(live)
    for seq in live:
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == 32


def test_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4, enable_prefix_caching=True)

"""Scheduling draft tokens and rolling back rejected ones (torch-free, a fake verifier)."""

from __future__ import annotations

import random

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import SamplingParams


def make(num_blocks: int = 32, budget: int = 64, lookahead: int = 0) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=512,
        enable_chunked_prefill=True,
        num_lookahead_slots=lookahead,
    )
    return Scheduler(config, BlockManager(num_blocks, 4, enable_prefix_caching=True))


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 100) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, params, None)


def test_rejected_drafts_roll_back_and_never_enter_the_prefix_cache() -> None:
    sched = make()
    bm = sched.block_manager
    seq = make_seq(0, [11, 12, 13, 14, 15, 16])
    sched.add(seq)
    out = sched.schedule()  # prefill: 6 tokens
    sched.update(out, {0: [17]}, {0: [18, 19, 20, 21]})
    assert seq.spec_token_ids == [18, 19, 20, 21]

    out = sched.schedule()  # the last token and 4 drafts: positions 6..10, 3 blocks
    (item,) = out.scheduled
    assert item.num_new_tokens == 5 and item.spec_token_ids == [18, 19, 20, 21]
    assert len(seq.block_table) == 3
    # the first draft is rejected: block 1 (positions 4..7) was full only with a draft
    sched.update(out, {0: [99]})
    assert seq.token_ids == [11, 12, 13, 14, 15, 16, 17, 99]
    assert seq.num_computed_tokens == 7
    assert len(seq.block_table) == 2  # the block only drafts reached is freed
    assert bm.blocks[seq.block_table[1]].block_hash is None  # not cached with draft K/V
    sched.check_integrity()

    out = sched.schedule()  # computes token 99 at position 7: block 1 is now full and right
    sched.update(out, {0: [5]})
    cached = bm.blocks[seq.block_table[1]]
    assert cached.token_ids == (15, 16, 17, 99)
    assert bm.hash_to_block[seq.block_hashes[1]] is cached
    sched.check_integrity()


def test_accepted_drafts_advance_several_tokens() -> None:
    sched = make()
    seq = make_seq(0, [1, 2, 3])
    sched.add(seq)
    sched.update(sched.schedule(), {0: [4]}, {0: [5, 6, 7]})
    out = sched.schedule()
    sched.update(out, {0: [5, 6, 7, 8]}, {0: [9]})  # all accepted, plus a bonus token
    assert seq.output_token_ids == [4, 5, 6, 7, 8]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 7
    assert seq.spec_token_ids == [9]
    sched.check_integrity()


def test_drafts_are_cut_to_budget_and_max_tokens() -> None:
    sched = make(budget=8)
    a, b = make_seq(0, [1, 2, 3], max_tokens=3), make_seq(1, [4, 5, 6])
    for s in (a, b):
        sched.add(s)
    sched.update(sched.schedule(), {0: [7], 1: [8]}, {0: [1, 2, 3, 4], 1: [1, 2, 3, 4, 5, 6]})
    out = sched.schedule()
    drafts = {item.seq.seq_id: item.spec_token_ids for item in out.scheduled}
    assert drafts[0] == [1]  # 1 token out, max_tokens 3: at most 1 draft + 1 token
    assert drafts[1] == [1, 2, 3, 4, 5]  # the rest of the 8-token budget
    assert out.num_batched_tokens == 8
    # a stop inside the accepted run: max_tokens ends a after its 3rd token
    sched.update(out, {0: [1, 9], 1: [1, 2, 0]})
    assert a.output_token_ids == [7, 1, 9] and a.is_finished
    assert b.output_token_ids == [8, 1, 2, 0]
    sched.check_integrity()


def test_no_preemption_for_drafts() -> None:
    # 4 blocks of 4: two sequences of 7 tokens each hold 2 blocks; drafts would need a third
    sched = make(num_blocks=4)
    seqs = [make_seq(i, [10 * i + t for t in range(1, 7)], max_tokens=4) for i in range(2)]
    for s in seqs:
        sched.add(s)
    sched.update(sched.schedule(), {0: [7], 1: [7]}, {0: [8, 9], 1: [8, 9]})
    out = sched.schedule()
    assert not out.preempted and sched.num_preemptions == 0
    assert [item.spec_token_ids for item in out.scheduled] == [[], []]
    sched.check_integrity()


def test_random_verify_outcomes_keep_the_allocator_consistent() -> None:
    """Random drafts, random acceptance, lookahead slots, preemption under a small cache."""
    rng = random.Random(0)
    sched = make(num_blocks=24, budget=16, lookahead=2)
    for i in range(6):
        sched.add(make_seq(i, [rng.randrange(50) for _ in range(rng.randint(1, 12))], 20))
    verified = 0
    for _ in range(500):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        sampled, proposals = {}, {}
        for item in out.scheduled:
            if not item.samples:
                continue
            d = item.spec_token_ids
            accepted = rng.randint(0, len(d))
            verified += accepted
            sampled[item.seq.seq_id] = d[:accepted] + [rng.randrange(50)]
            proposals[item.seq.seq_id] = [rng.randrange(50) for _ in range(rng.randint(0, 4))]
        for seq in sched.update(out, sampled, proposals):
            assert seq.is_finished or seq.num_computed_tokens == seq.num_tokens - 1
        sched.check_integrity()
        bm = sched.block_manager
        for block in bm.hash_to_block.values():  # cached blocks hold what their hash says
            assert block.token_ids is not None
    assert not sched.num_unfinished
    assert sched.num_preemptions > 0 and verified > 0
    assert sched.block_manager.num_free_blocks == 24

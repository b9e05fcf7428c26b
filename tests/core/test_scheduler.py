"""Scheduler invariants with a fake model, without torch: nothing lost, nothing duplicated."""

from __future__ import annotations

import random

from helpers.sequences import make_seq

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceStatus


def make_scheduler(
    num_blocks=64, block_size=4, max_seqs=8, max_tokens=32, chunked=True, caching=True
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=512,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, caching))


def drive(sched: Scheduler, max_steps: int = 10_000) -> list[int]:
    """Run to completion with a fake model that samples token 7; returns tokens per step."""
    per_step = []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return per_step
        out = sched.schedule()
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "sequence scheduled twice in a step"
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        sampled = {s.seq.seq_id: [7] for s in out.scheduled if s.samples}
        sched.update(out, sampled)
        sched.check_integrity()
        per_step.append(out.num_batched_tokens)
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_splits_long_prompt():
    sched = make_scheduler(max_tokens=16)
    seq = make_seq(0, range(1, 40 + 1), max_tokens=3, ignore_eos=True)
    sched.add(seq)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [16]
    assert not out.scheduled[0].samples
    sched.update(out, {})
    assert seq.num_computed_tokens == 16 and seq.num_output_tokens == 0
    drive(sched)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.output_token_ids == [7, 7, 7]
    assert sched.num_prefill_chunks == 2  # 16 + 16 tokens; the last 8 reach the end and sample


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_tokens=32, chunked=False)
    a, b = (
        make_seq(0, range(1, 20 + 1), max_tokens=2, ignore_eos=True),
        make_seq(1, range(1, 20 + 1), max_tokens=2, ignore_eos=True),
    )
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert sched.num_prefill_chunks == 0


def test_decode_runs_before_new_prefills():
    sched = make_scheduler(max_tokens=16)
    a = make_seq(0, range(1, 8 + 1), max_tokens=5, ignore_eos=True)
    sched.add(a)
    sched.update(sched.schedule(), {0: [7]})
    sched.add(make_seq(1, range(1, 30 + 1), max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    assert out.scheduled[0].seq is a and out.scheduled[0].num_new_tokens == 1
    assert out.scheduled[1].num_new_tokens == 15


def test_preemption_recomputes_and_loses_nothing():
    sched = make_scheduler(num_blocks=12, block_size=4, max_seqs=6, max_tokens=64)
    seqs = [make_seq(i, range(1, 6 + 1), max_tokens=20, ignore_eos=True) for i in range(6)]
    for s in seqs:
        sched.add(s)
    drive(sched)
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.status == SequenceStatus.FINISHED_LENGTH
        assert s.output_token_ids == [7] * 20
    assert sched.block_manager.num_free_blocks == 12


def test_random_load_finishes_everything():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=40, block_size=4, max_seqs=5, max_tokens=24)
    seqs = [
        make_seq(
            i, range(1, rng.randint(1, 50) + 1), max_tokens=rng.randint(1, 30), ignore_eos=True
        )
        for i in range(40)
    ]
    for s in seqs:
        sched.add(s)
    drive(sched)
    for s in seqs:
        assert s.is_finished and s.num_output_tokens == s.sampling_params.max_tokens


def test_abort_frees_blocks_in_any_state():
    sched = make_scheduler(max_tokens=8)
    running, chunking, waiting = (
        make_seq(0, range(1, 4 + 1), max_tokens=50, ignore_eos=True),
        make_seq(1, range(1, 30 + 1), max_tokens=5, ignore_eos=True),
        make_seq(2, range(1, 4 + 1), max_tokens=5, ignore_eos=True),
    )
    for s in (running, chunking, waiting):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, {s.seq.seq_id: [7] for s in out.scheduled if s.samples})
    for s in (running, chunking, waiting):
        sched.finish(s, SequenceStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.num_unfinished == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_prompt_larger_than_cache_is_rejected_up_front():
    sched = make_scheduler(num_blocks=4, block_size=4)
    try:
        sched.add(make_seq(0, range(1, 20 + 1), max_tokens=1, ignore_eos=True))
    except ValueError as e:
        assert "never fit" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_prompts_sharing_an_uncomputed_prefix_wait_for_the_first_to_compute_it():
    """Three prompts behind one 12-token prefix (3 blocks of 4) arrive together, with a fourth
    that shares nothing: the first computes the prefix, the other two wait a step (skipped,
    the fourth runs meanwhile) and then find its blocks cached instead of computing them."""
    sched = make_scheduler(max_tokens=64)
    prefix = list(range(100, 112))
    sharing = [make_seq(i, prefix + [i, i + 1], max_tokens=2, ignore_eos=True) for i in range(3)]
    other = make_seq(3, range(200, 214), max_tokens=2, ignore_eos=True)
    for seq in [*sharing, other]:
        sched.add(seq)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 14), (3, 14)]
    assert sched.num_prefix_waits == 2
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # their place in the queue kept
    sched.update(out, {0: [7], 3: [7]})
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [
        (0, 1),
        (3, 1),
        (1, 2),
        (2, 2),
    ]
    assert sharing[1].num_cached_tokens == sharing[2].num_cached_tokens == 12
    assert sched.block_manager.prefix_cache_hits == 24
    assert sched.num_prefix_waits == 2
    drive(sched)
    assert all(s.output_token_ids == [7, 7] for s in [*sharing, other])


def test_a_prefix_wait_lasts_while_a_chunked_prefill_computes_it():
    """A 40-token shared prefix and a budget of 16: the first prompt's chunks take the whole
    budget twice; its last chunk (10 tokens) leaves room, but the second prompt's first
    missing block is in that chunk, so it waits once more, then computes only its own last
    2 tokens."""
    sched = make_scheduler(max_tokens=16)
    prefix = list(range(100, 140))
    a = make_seq(0, prefix + [1, 2], max_tokens=1, ignore_eos=True)
    b = make_seq(1, prefix + [3, 4], max_tokens=1, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    computed_by_b = []
    while b.num_computed_tokens == 0 or not computed_by_b:
        out = sched.schedule()
        computed_by_b += [s.num_new_tokens for s in out.scheduled if s.seq is b]
        sched.update(out, {s.seq.seq_id: [7] for s in out.scheduled if s.samples})
    assert computed_by_b == [2] and b.num_cached_tokens == 40
    assert sched.num_prefix_waits == 1


def test_without_prefix_caching_nobody_waits_for_a_prefix():
    sched = make_scheduler(max_tokens=64, caching=False)
    prefix = list(range(100, 112))
    for i in range(3):
        sched.add(make_seq(i, prefix + [i], max_tokens=1, ignore_eos=True))
    assert len(sched.schedule().scheduled) == 3 and sched.num_prefix_waits == 0

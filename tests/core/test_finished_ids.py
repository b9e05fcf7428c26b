"""Finished sequence ids reach the workers inside the next scheduler output."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams


def _seq(seq_id: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", 0, [1, 2, 3], params, None)


def test_finished_and_aborted_ids_ride_on_the_next_non_empty_step():
    config = SchedulerConfig(8, 64, 64, True)
    sched = Scheduler(config, BlockManager(16, 4, True))
    a, b = _seq(0, 1), _seq(1, 5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.finished_seq_ids == []
    sched.update(out, {0: 7, 1: 7})  # a reaches max_tokens=1 and finishes
    assert a.is_finished
    out = sched.schedule()
    assert out.finished_seq_ids == [0] and [s.seq.seq_id for s in out.scheduled] == [1]
    sched.update(out, {1: 8})
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    empty = sched.schedule()  # nothing to run: the id waits for a step that runs
    assert empty.is_empty and empty.finished_seq_ids == []
    sched.add(_seq(2, 2))
    out = sched.schedule()
    assert out.finished_seq_ids == [1]

"""Scheduler.finish is the one place a sequence ends: every reason, and a stop string found
after the step's tokens had already ended it."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams


def _running(sched: Scheduler, max_tokens: int) -> Sequence:
    seq = Sequence(0, "r0", 0, [1, 2, 3], SamplingParams(max_tokens=max_tokens), None)
    sched.add(seq)
    sched.update(sched.schedule(), {0: [7]})
    return seq


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 64, True), BlockManager(16, 4, True))


def test_a_stop_string_ends_a_running_sequence_and_frees_its_blocks() -> None:
    sched = _scheduler()
    seq = _running(sched, max_tokens=10)
    assert seq.block_table and sched.running == [seq]
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED, stop_reason="###")
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "###"
    assert not seq.block_table and sched.num_unfinished == 0
    sched.add(Sequence(1, "r1", 0, [4, 5], SamplingParams(max_tokens=2), None))
    assert sched.schedule().finished_seq_ids == [0]
    sched.check_integrity()


def test_a_stop_string_before_a_length_end_of_the_same_step_wins() -> None:
    """Accepted drafts: the step's three tokens reach max_tokens, but the text completes a
    stop string at the first one; the output is cut there and the end is the stop string."""
    sched = _scheduler()
    seq = _running(sched, max_tokens=4)
    out = sched.schedule()
    sched.update(out, {0: [8, 9, 10]})
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 4
    seq.truncate_output(2)
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED, stop_reason="\n")
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "\n"
    assert seq.output_token_ids == [7, 8]
    # ended once: the id reaches the workers once, and a later abort changes nothing
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    sched.add(Sequence(1, "r1", 0, [4, 5], SamplingParams(max_tokens=2), None))
    assert sched.schedule().finished_seq_ids == [0]
    sched.check_integrity()


def test_only_the_scheduler_writes_a_sequence_status() -> None:
    """Nothing outside core/scheduler.py ends (or otherwise moves) a sequence by writing its
    status: the scheduler would keep it queued and its blocks allocated."""
    import re
    from pathlib import Path

    import pagedllm

    root = Path(pagedllm.__file__).parent
    writers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path != root / "core" / "scheduler.py"
        and re.search(r"seq\.status\s*=(?!=)", path.read_text())
    ]
    assert writers == []

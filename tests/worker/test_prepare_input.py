"""ModelRunner.prepare_input's rows for the LM head: every token row only where that is what
logits_indices lists."""

from __future__ import annotations

from helpers.sequences import make_seq

from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput


def _scheduled(*items: tuple) -> SchedulerOutput:
    """(seq, tokens this step) pairs, each sequence on blocks of its own."""
    scheduled, next_block = [], 0
    for seq, n in items:
        blocks = -(-seq.num_tokens // 4)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledSequence(seq, n))
    return SchedulerOutput(scheduled, sum(n for _, n in items))


def test_a_decode_step_sends_every_row_to_the_lm_head(small_runner):
    seqs = [make_seq(i, range(5, 10), output=[11], temperature=0.0) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = 5
    inp = small_runner.prepare_input(_scheduled(*((seq, 1) for seq in seqs)))
    assert inp.logits_indices.tolist() == [0, 1, 2] and inp.logits_all_rows
    assert inp.positions.tolist() == [5, 5, 5]


def test_as_many_logits_rows_as_tokens_is_not_every_row_in_order(small_runner):
    """A last prompt chunk with prompt logprobs lists its last row twice (its own logprobs and
    the sample), a first chunk of another prompt lists none: four rows for four tokens, yet
    not rows 0-3."""
    last = make_seq(0, [5, 6, 7], temperature=0.0, prompt_logprobs=1)
    first = make_seq(1, [5, 6, 7, 8, 9], temperature=0.0)
    inp = small_runner.prepare_input(_scheduled((last, 3), (first, 1)))
    assert inp.logits_indices.tolist() == [0, 1, 2, 2]
    assert inp.sample_rows == [3]
    assert not inp.logits_all_rows
    assert inp.positions.tolist() == [0, 1, 2, 0]
    assert inp.metadata.slot_mapping.tolist() == [0, 1, 2, 4]

"""In-process checks of the overlap machinery and the rank layout (no worker processes)."""

from __future__ import annotations

import pytest
import torch
from helpers.sequences import make_seq

from pagedllm.config import EngineArgs, ParallelConfig
from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.distributed.communicator import OverlapCommunicator
from pagedllm.distributed.parallel_state import placement
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.multiproc_executor import StepInput
from pagedllm.worker.overlap import forward_overlapped, split_batch


def _mixed_batch(block_size: int) -> SchedulerOutput:
    """A prefill of 6 tokens, a 3-token chunk after 4 cached tokens, and a decode token."""
    scheduled, next_block = [], 0
    for seq_id, (length, computed) in enumerate([(6, 0), (7, 4), (9, 8)]):
        seq = make_seq(seq_id, range(5, 5 + length), temperature=0.0, max_tokens=4)
        seq.num_computed_tokens = computed
        blocks = -(-length // block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledSequence(seq, length - computed))
    return SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled))


@pytest.fixture
def runner(small_runner) -> ModelRunner:
    return small_runner


def test_split_cuts_at_the_sequence_boundary_nearest_half(runner):
    inp = runner.prepare_input(_mixed_batch(runner.block_size))
    a, b = split_batch(inp.input_ids, inp.positions, inp.metadata)
    # tokens per sequence 6 | 3, 1: the cut after the first sequence is nearest 10 / 2
    assert a.metadata.query_lens_cpu == [6] and b.metadata.query_lens_cpu == [3, 1]
    assert b.metadata.batch.cu_seqlens_q.tolist() == [0, 3, 4]
    assert b.metadata.seq_lens_cpu == [7, 9] and b.metadata.batch.max_seqlen_k == 9
    assert torch.equal(torch.cat([a.positions, b.positions]), inp.positions)
    md = inp.metadata
    assert torch.equal(b.metadata.slot_mapping, md.slot_mapping[6:])
    assert torch.equal(b.metadata.block_table, md.block_table[1:])
    one = runner.prepare_input(SchedulerOutput(_mixed_batch(4).scheduled[:1], 6))
    assert split_batch(one.input_ids, one.positions, one.metadata) is None


def test_overlapped_forward_equals_the_plain_forward(runner):
    inp = runner.prepare_input(_mixed_batch(runner.block_size))
    plain = runner.forward(inp)
    comm = OverlapCommunicator()  # world size 1: the same schedule, reductions are no-ops
    batches = split_batch(inp.input_ids, inp.positions, inp.metadata)
    with torch.inference_mode():
        overlapped = forward_overlapped(runner.model, batches, comm)
    assert overlapped.shape == plain.shape
    torch.testing.assert_close(overlapped, plain, rtol=1e-5, atol=1e-5)


def test_step_input_round_trips_through_host_arrays(runner):
    inp = runner.prepare_input(_mixed_batch(runner.block_size))
    back = StepInput.from_input(inp, overlap=True).to_input(torch.device("cpu"))
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(back, name), getattr(inp, name))
    for name in ("cu_seqlens_q", "seq_lens_k", "block_table"):
        assert torch.equal(getattr(back.metadata.batch, name), getattr(inp.metadata.batch, name))
    assert torch.equal(back.metadata.slot_mapping, inp.metadata.slot_mapping)
    assert back.metadata.query_lens_cpu == inp.metadata.query_lens_cpu


def test_ranks_are_laid_out_node_by_node(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    node1 = placement(ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1))
    assert (node1.rank, node1.local_ranks, node1.launched) == (2, (3,), False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    launched = placement(ParallelConfig(tensor_parallel_size=4))
    assert (launched.rank, launched.local_ranks, launched.launched) == (3, (), True)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        placement(ParallelConfig(tensor_parallel_size=2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tensor_parallel_size=3, nnodes=2), "multiple of nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
    ],
)
def test_bad_parallel_arguments_are_rejected(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(str(tiny_llama), **kwargs).create_engine_config()

"""Decode CUDA graphs (worker/cuda_graphs.py) without a GPU: the batch sizes captured, and
DecodeGraphs.run's static buffers on the CPU, each replay standing in as the forward over the
same buffers (what a captured graph replays). The captured graphs themselves run in
tests/cuda on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.sequences import make_seq

from pagedllm.config import EngineArgs
from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.worker.cuda_graphs import DecodeGraphs, _Graph, capture_sizes
from pagedllm.worker.model_runner import ModelRunner

BLOCKS, BLOCK = 32, 4
PAD_SLOT = (BLOCKS - 1) * BLOCK  # the last block stands for the scratch block: no one owns it


def test_capture_sizes_follow_the_batch_limit():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256


def test_cpu_runner_captures_no_graphs_and_no_scratch_block(small_runner):
    assert small_runner.graphs is None
    assert small_runner.kv_caches[0][0].shape[0] == small_runner.num_blocks == 16


class ForwardAgain:
    """A captured graph's stand-in: each replay runs the forward over the static buffers and
    writes the graph's output tensor."""

    def __init__(self, graphs: DecodeGraphs, size: int, output: torch.Tensor) -> None:
        self.graphs, self.size, self.output = graphs, size, output

    def replay(self) -> None:
        self.output.copy_(self.graphs._forward(self.size))


@pytest.fixture(scope="module")
def runner(tiny_llama):
    args = EngineArgs(str(tiny_llama), dtype="float32", block_size=BLOCK)
    runner = ModelRunner.from_engine_config(args.create_engine_config())
    runner.allocate_kv_cache(BLOCKS)
    return runner


@pytest.fixture()
def graphs(runner):
    sizes = [1, 2, 4, 8]
    graphs = DecodeGraphs(
        runner.model, sizes, runner.scheduler_config.max_model_len, BLOCK, PAD_SLOT,
        torch.device("cpu"),
    )  # fmt: skip
    hidden = runner.model.model.norm.weight.shape[0]
    for size in sizes:
        output = torch.empty(size, hidden)
        graphs.graphs[size] = _Graph(ForwardAgain(graphs, size, output), output)  # type: ignore[arg-type]
    return graphs


def step(runner, seqs):
    """The decode step of each sequence's next token."""
    items = [ScheduledSequence(s, 1) for s in seqs]
    return runner.prepare_input(SchedulerOutput(items, len(items)))


def caches(runner) -> torch.Tensor:
    return torch.stack([torch.stack(kv) for kv in runner.kv_caches]).clone()


@torch.inference_mode()
def test_padded_decode_over_stale_buffers_matches_the_eager_step(runner, graphs):
    """Eight sequences decode through the 8-row buffers, then three of them through the
    4-row ones (one padding row, rows 3-7 still holding the first step's): each step's hidden
    states are the eager forward's, its K/V land in the sequences' slots, and the padding row
    writes only the scratch block."""
    seqs = []
    for i in range(8):  # prompts of 2-9 tokens, then two outputs: 3 blocks each, 0-23
        seq = make_seq(i, range(3, 5 + i), output=[40 + i, 60 + i], temperature=0.0)
        seq.block_table = [3 * i + b for b in range(3)]
        seqs.append(seq)
    runner.forward(prompt_step(runner, seqs))
    for seq in seqs:
        seq.num_computed_tokens = seq.num_prompt_tokens

    for batch in (seqs, seqs[:3]):
        inp = step(runner, batch)
        before = caches(runner)
        got = graphs.run(inp.input_ids, inp.positions, inp.metadata)
        after_graph = caches(runner)
        restore(runner, before)
        want = runner.forward(inp, layer_by_layer=True)
        assert got is not None and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        changed = (after_graph != before).flatten(4).any(-1)  # [layers, k/v, block, slot]
        slots = changed.any(0).any(0).flatten().nonzero().flatten().tolist()
        padding = [PAD_SLOT] if graphs.size_for(len(batch)) > len(batch) else []
        assert slots == sorted(inp.metadata.slot_mapping.tolist() + padding)
        for seq in batch:
            seq.num_computed_tokens += 1
    assert graphs.replays == 2 and graphs.size_for(3) == 4


def prompt_step(runner, seqs):
    items = [ScheduledSequence(s, s.num_prompt_tokens) for s in seqs]
    return runner.prepare_input(SchedulerOutput(items, sum(i.num_new_tokens for i in items)))


def restore(runner, saved: torch.Tensor) -> None:
    for layer, (k, v) in enumerate(runner.kv_caches):
        k.copy_(saved[layer, 0])
        v.copy_(saved[layer, 1])


@torch.inference_mode()
def test_steps_no_graph_replays_are_left_to_the_caller(runner, graphs):
    """A prompt step, and a decode of more sequences than the largest graph: None."""
    seqs = [make_seq(i, [5, 6, 7], output=[8], temperature=0.0) for i in range(9)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    prompt = prompt_step(runner, seqs[:2])
    assert graphs.run(prompt.input_ids, prompt.positions, prompt.metadata) is None
    for seq in seqs:
        seq.num_computed_tokens = 3
    wide = step(runner, seqs)
    assert graphs.run(wide.input_ids, wide.positions, wide.metadata) is None
    assert graphs.replays == 0

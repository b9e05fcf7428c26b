"""The batch sizes decode CUDA graphs are captured for (worker/cuda_graphs.py); the graphs
themselves run in tests/cuda on a GPU."""

from __future__ import annotations

from pagedllm.worker.cuda_graphs import capture_sizes


def test_capture_sizes_follow_the_batch_limit():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256


def test_cpu_runner_captures_no_graphs_and_no_scratch_block(small_runner):
    assert small_runner.graphs is None
    assert small_runner.kv_caches[0][0].shape[0] == small_runner.num_blocks == 16

"""Decode steps as CUDA graphs (worker/cuda_graphs.py), skipped without a GPU: the same
greedy tokens as the eager engine and as transformers, padded batch sizes, the steps that
stay eager, and the counters that prove which ran."""

from __future__ import annotations

import pytest
import torch
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy

from pagedllm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def engine(model_dir, **kwargs) -> LLM:
    args = dict(dtype="float32", device="cuda", block_size=4, kv_cache_memory_bytes=1 << 22)
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def runner_of(llm: LLM):
    return llm.llm_engine.executor.runner


@pytest.mark.parametrize("num_prompts", [1, 3, 5, 20])
def test_graphed_decode_matches_eager_and_hf(model_factory, num_prompts):
    """Batches of 3, 5 and 20 replay the graphs of 4, 8 and 32 rows (padding rows write to
    the scratch block): the same tokens as eager steps and as transformers."""
    model_dir = model_factory("llama")
    prompts = random_prompts(num_prompts, 3, 30, seed=num_prompts)
    graphed = engine(model_dir, max_num_seqs=32)
    runner = runner_of(graphed)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 32]
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks + 1  # the scratch block
    assert graphs.pad_slot == runner.num_blocks * runner.block_size
    got = greedy(graphed, prompts, 12)
    assert graphs.replays >= 11  # every step after the prefill(s) decodes all sequences
    eager = engine(model_dir, max_num_seqs=32, enforce_eager=True)
    assert runner_of(eager).graphs is None
    assert got == greedy(eager, prompts, 12) == hf_greedy(model_dir, prompts, 12)


def test_chunked_prefill_and_preemption_with_graphs_match_hf(model_factory):
    """Prompt chunks share steps with decodes (those steps run eagerly), a small cache
    preempts sequences, and the decode-only steps replay graphs: the tokens stay those of
    transformers' full recompute (its cached path drifts past the window)."""
    from helpers.oracle import hf_greedy_recompute

    model_dir = model_factory("mistral")  # a sliding window of 24
    prompts = random_prompts(6, 20, 60, seed=11)
    llm = engine(
        model_dir, max_num_seqs=8, max_num_batched_tokens=16, kv_cache_memory_bytes=40 * 2048
    )
    got = greedy(llm, prompts, 16)
    sched = llm.llm_engine.scheduler
    assert sched.num_prefill_chunks > 0 and sched.num_preemptions > 0
    assert runner_of(llm).graphs.replays > 0
    assert got == hf_greedy_recompute(model_dir, prompts, 16)


def test_batches_past_the_largest_graph_run_eagerly(model_factory):
    """max_num_seqs 6 captures 1, 2, 4 and 6 rows; 6 sequences replay the 6-row graph."""
    model_dir = model_factory("qwen2")
    prompts = random_prompts(6, 5, 12, seed=12)
    llm = engine(model_dir, max_num_seqs=6)
    graphs = runner_of(llm).graphs
    assert graphs.sizes == [1, 2, 4, 6] and graphs.size_for(7) is None
    assert greedy(llm, prompts, 8) == hf_greedy(model_dir, prompts, 8)
    assert graphs.replays > 0


def test_models_with_kv_cache_groups_run_eagerly(model_factory):
    """Gemma 3's sliding and global layers keep two block pools: no graphs, same tokens."""
    from helpers.oracle import hf_greedy_recompute

    model_dir = model_factory("gemma3")
    prompts = random_prompts(2, 5, 20, seed=13)
    llm = engine(model_dir)
    assert runner_of(llm).graphs is None
    assert greedy(llm, prompts, 6) == hf_greedy_recompute(model_dir, prompts, 6)

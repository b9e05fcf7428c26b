"""The engine on a CUDA GPU (Triton attention, CUDA graphs for decode) gives transformers'
greedy tokens (fp32) in every regime the CPU parity suite covers; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy, hf_greedy_recompute

from pagedllm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(model_dir, prompts, max_tokens, **engine_kwargs):
    kwargs = dict(dtype="float32", device="cuda", block_size=4, kv_cache_memory_bytes=1 << 20)
    kwargs.update(engine_kwargs)
    llm = LLM(str(model_dir), **kwargs)
    return llm, greedy(llm, prompts, max_tokens)


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"])
def test_mixed_batch_on_gpu_matches_hf(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, 1, 40)
    _, got = run(model_dir, prompts, 12)
    assert got == hf_greedy(model_dir, prompts, 12)


def test_triton_ops_on_gpu_match_hf(model_factory, monkeypatch):
    """PAGEDLLM_CUDA_FUSED_OPS=1: the norms, SwiGLU and rotary run as Triton kernels
    (layers/triton_ops.py), under CUDA graphs too: the same tokens."""
    monkeypatch.setenv("PAGEDLLM_CUDA_FUSED_OPS", "1")
    model_dir = model_factory("qwen3")  # per-head q / k norms as well
    prompts = random_prompts(6, 1, 40, seed=8)
    llm, got = run(model_dir, prompts, 12)
    model = llm.llm_engine.executor.runner.model
    impls = {type(m).__name__: m.impl for m in model.modules() if hasattr(m, "impl")}
    assert impls["RMSNorm"] == impls["SiluAndMul"] == impls["RotaryEmbedding"] == "cuda"
    assert got == hf_greedy(model_dir, prompts, 12)


def test_chunked_prefill_on_gpu_matches_hf(model_factory):
    model_dir = model_factory("llama")
    prompts = random_prompts(4, 30, 70, seed=1)
    llm, got = run(model_dir, prompts, 10, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.llm_engine.scheduler.num_prefill_chunks >= 4
    assert got == hf_greedy(model_dir, prompts, 10)


def test_prefix_cache_hits_on_gpu_match_hf(model_factory):
    model_dir = model_factory("qwen2")
    shared = random_prompts(1, 37, 37, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 9, seed=3)]
    llm, first = run(model_dir, prompts, 8)
    hits = llm.llm_engine.block_manager.prefix_cache_hits
    again = greedy(llm, prompts, 8)
    assert llm.llm_engine.block_manager.prefix_cache_hits - hits >= 4 * 36
    assert first == again == hf_greedy(model_dir, prompts, 8)


def test_preemption_on_gpu_matches_hf(model_factory):
    model_dir = model_factory("mistral")
    prompts = random_prompts(6, 10, 30, seed=4)
    llm, got = run(model_dir, prompts, 16, kv_cache_memory_bytes=24 * 2048)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == hf_greedy(model_dir, prompts, 16)


def test_prompt_past_the_window_on_gpu_matches_recompute(model_factory):
    model_dir = model_factory("mistral")  # sliding_window = 24
    prompts = random_prompts(3, 60, 90, seed=5)
    _, got = run(model_dir, prompts, 20, max_num_batched_tokens=32)
    assert got == hf_greedy_recompute(model_dir, prompts, 20)


def test_bf16_on_gpu_within_hf_top5(model_factory):
    """bfloat16 on both sides (transformers on the CPU): vLLM's criterion, equal or at
    the first difference each token in the other's top 5."""
    from helpers.logprobs import check_logprobs_close, hf_greedy_top, pagedllm_greedy
    from transformers import AutoModelForCausalLM

    model_dir = model_factory("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=1 << 22)
    for prompt in random_prompts(4, 5, 30, seed=6):
        ours, theirs = pagedllm_greedy(llm, prompt, 10), hf_greedy_top(hf, prompt, 10)
        check_logprobs_close(ours, theirs, ("pagedllm", "transformers"))

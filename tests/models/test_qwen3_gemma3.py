"""Qwen3 and Gemma 3 (tiny random configs, tests/helpers/models.py) give transformers' greedy
tokens, every step recomputed from the whole sequence there, through chunked prefill, prefix
hits, preemption, prompts past Gemma's window of 8, and tensor parallel over two processes.
Both served by the fused CPU decoder from their layers' declarations (asserted)."""

from __future__ import annotations

import pytest
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy_recompute
from helpers.tp import BASE, generate_both_ways

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cpu_decoder import CpuFusedDecoder

ARCHS = ["qwen3", "gemma3"]
# KV bytes of one 4-token fp32 block: layers x K,V x 4 slots x 2 heads x 32 dims x 4 bytes
BLOCK_BYTES = {"qwen3": 2 * 2 * 4 * 2 * 32 * 4, "gemma3": 3 * 2 * 4 * 2 * 32 * 4}


@pytest.fixture(scope="module")
def oracle():
    cache: dict = {}

    def get(model_dir, prompts, max_tokens):  # noqa: ANN001, ANN202
        key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens)
        if key not in cache:
            cache[key] = hf_greedy_recompute(model_dir, prompts, max_tokens)
        return cache[key]

    return get


def engine(model_dir, **kwargs) -> LLM:  # noqa: ANN001
    llm = LLM(str(model_dir), **{**BASE, **kwargs})
    assert isinstance(llm.llm_engine.executor.local_runner.fast_path, CpuFusedDecoder)
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prompts_past_the_window_match_hf(model_factory, oracle, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(4, 20, 60, seed=1)  # all longer than Gemma's window of 8
    llm = engine(model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    got = greedy(llm, prompts, 10)
    chunks = sum(-(-len(p) // 16) - 1 for p in prompts)
    assert llm.llm_engine.scheduler.num_prefill_chunks >= chunks
    assert got == oracle(model_dir, prompts, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_match_hf(model_factory, oracle, arch):
    model_dir = model_factory(arch)
    shared = random_prompts(1, 29, 29, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(3, 1, 9, seed=3)]
    llm = engine(model_dir)
    first = greedy(llm, prompts, 8)
    hits = llm.llm_engine.block_manager.prefix_cache_hits
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.block_manager.prefix_cache_hits - hits >= 3 * 28
    assert first == again == oracle(model_dir, prompts, 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_hf(model_factory, oracle, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, 10, 30, seed=4)
    # 24 blocks hold 96 tokens, far fewer than the 6 sequences need together (up to ~280)
    llm = engine(model_dir, kv_cache_memory_bytes=24 * BLOCK_BYTES[arch])
    got = greedy(llm, prompts, 16)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == oracle(model_dir, prompts, 16)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_hf(model_factory, oracle, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(4, 5, 30, seed=6)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **BASE)
    try:
        if arch == "qwen3":  # with and without overlapped all-reduces (asserted to run)
            got = generate_both_ways(llm, prompts, 10)
        else:  # Gemma's norms after the all-reduces: its layers never split for overlap
            got = greedy(llm, prompts, 10)
    finally:
        llm.llm_engine.shutdown()
    assert got == oracle(model_dir, prompts, 10)


def test_gemma3_layers_declare_their_kind(model_factory):
    """Sliding layers: window 8 and the local rotary base, sharing one table; the global
    layer: no window, its own base; every layer Gemma's norms, GeGLU and query scale."""
    llm = engine(model_factory("gemma3"))
    layers = llm.llm_engine.executor.local_runner.model.model.layers
    specs = [layer.spec for layer in layers]
    assert [s.window_left for s in specs] == [7, -1, 7]
    assert [s.rope_theta for s in specs] == [10000.0, 1000000.0, 10000.0]
    assert all(s.norm_offset and s.qk_norm and s.post_attention_norm and s.post_mlp_norm
               for s in specs)  # fmt: skip
    assert {s.activation for s in specs} == {"gelu_tanh"}
    assert {s.scale for s in specs} == {24**-0.5}
    rotary = [layer.self_attn.rotary_emb for layer in layers]
    assert rotary[0].cos is rotary[2].cos and rotary[0].cos is not rotary[1].cos

"""Greedy outputs match Hugging Face transformers token for token (fp32), in every regime."""

from __future__ import annotations

import pytest
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "llama3_rope", "mistral", "qwen2"]


def run(model_dir, prompts, max_tokens, **engine_kwargs):
    kwargs = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
    kwargs.update(engine_kwargs)
    llm = LLM(str(model_dir), **kwargs)
    return llm, greedy(llm, prompts, max_tokens)


def min_chunks(prompts: list[list[int]], budget: int) -> int:
    """Prompt pieces that end short of their prompt when at most budget tokens run a step."""
    return sum(-(-len(p) // budget) - 1 for p in prompts)


@pytest.fixture(scope="module")
def hf_cache():
    return {}


def expected(hf_cache, model_dir, prompts, max_tokens):
    key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens)
    if key not in hf_cache:
        hf_cache[key] = hf_greedy(model_dir, prompts, max_tokens)
    return hf_cache[key]


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_hf(model_factory, hf_cache, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, 1, 40)
    _, got = run(model_dir, prompts, 12)
    assert got == expected(hf_cache, model_dir, prompts, 12)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_matches_hf(model_factory, hf_cache, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(4, 30, 70, seed=1)
    llm, got = run(model_dir, prompts, 10, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.llm_engine.scheduler.num_prefill_chunks >= min_chunks(prompts, 16)
    assert got == expected(hf_cache, model_dir, prompts, 10)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_cache_hits_match_hf(model_factory, hf_cache, arch):
    model_dir = model_factory(arch)
    shared = random_prompts(1, 37, 37, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 9, seed=3)]
    llm, first = run(model_dir, prompts, 8)
    engine = llm.llm_engine
    hits_before = engine.block_manager.prefix_cache_hits
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine.block_manager.prefix_cache_hits - hits_before >= 4 * 36
    assert first == again == expected(hf_cache, model_dir, prompts, 8)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_matches_hf(model_factory, hf_cache, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, 10, 30, seed=4)
    # 2 layers x K,V x 4 slots x 2 heads x 16 dims x 4 bytes = 2 KiB per block; 24 blocks
    # hold 96 tokens, far fewer than the 6 sequences need together (up to ~240).
    llm, got = run(model_dir, prompts, 16, kv_cache_memory_bytes=24 * 2048)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == expected(hf_cache, model_dir, prompts, 16)


def test_mistral_prompt_longer_than_window(model_factory, hf_cache):
    """Prompts of 60-90 tokens, prefilled in chunks of at most 32, past a window of 24."""
    model_dir = model_factory("mistral")  # sliding_window = 24
    prompts = random_prompts(3, 60, 90, seed=5)
    llm, got = run(model_dir, prompts, 20, max_num_batched_tokens=32)
    assert llm.llm_engine.scheduler.num_prefill_chunks >= min_chunks(prompts, 32)
    assert got == expected(hf_cache, model_dir, prompts, 20)


def test_n_greater_than_one_shares_prompt_blocks(model_factory):
    model_dir = model_factory("llama")
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
    computed: list[int] = []  # tokens run through the model, step by step

    class Batched:
        def record(self, _scheduler_stats: object, iteration: object) -> None:
            computed.append(iteration.num_batched_tokens)

    llm.llm_engine.add_stat_logger(Batched())
    prompt = random_prompts(1, 33, 33, seed=6)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # the two followers reuse the leader's 8 full prompt blocks (32 tokens each): the prompt
    # is computed once (33 tokens) plus each follower's last prompt token, then 5 more decode
    # tokens per sample (the 6th sampled token is never fed back)
    assert sum(computed) == 33 + 2 * 1 + 3 * 5
    # the prompt was looked up once, for the request (vLLM counts so)
    assert llm.llm_engine.block_manager.prefix_cache_queries == 33
    seqs = {tuple(c.token_ids) for c in out.outputs}
    assert len(seqs) > 1  # distinct seeds per sample

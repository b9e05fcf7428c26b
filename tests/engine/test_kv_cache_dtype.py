"""kv_cache_dtype: the KV cache in another dtype than the model's (vLLM's engine argument).

An fp32 model with a bfloat16 cache keeps half the bytes a token, so a budget holds twice the
blocks; attention runs in the cache's dtype on every path (the modules, the fused CPU decoder,
the torch backend) and hands its output back in the model's.
"""

from __future__ import annotations

import pytest
import torch
from helpers.generation import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs


def run(model_dir, **kwargs) -> tuple[list[tuple[list[int], list[dict]]], LLM]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=32,  # prompts of 20-45 tokens run in chunks
        max_num_seqs=4,
        **{"kv_cache_memory_bytes": 1 << 20, **kwargs},
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = random_prompts(3, 20, 45, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


def chosen_logprobs(result):
    return [[entry[t].logprob for entry, t in zip(lps, ids)] for ids, lps in result]


def test_a_bfloat16_cache_holds_twice_the_blocks_of_an_fp32_one(tiny_llama):
    budget = 1 << 18  # 128 blocks of fp32 K/V: below what 4 sequences can use (513)
    _, auto = run(tiny_llama, kv_cache_memory_bytes=budget)
    _, half = run(tiny_llama, kv_cache_memory_bytes=budget, kv_cache_dtype="bfloat16")
    runner = half.llm_engine.executor.local_runner
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {torch.bfloat16}
    assert {t.dtype for pair in auto.llm_engine.executor.local_runner.kv_caches for t in pair} == {
        torch.float32
    }
    assert half.llm_engine.kv_cache.bytes_per_block * 2 == auto.llm_engine.kv_cache.bytes_per_block
    assert half.llm_engine.kv_cache.num_blocks == 2 * auto.llm_engine.kv_cache.num_blocks


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_the_fused_decoder_equals_the_modules_on_a_half_width_cache(tiny_llama, cache_dtype):
    """bf16, and fp16 (llama.cpp's default cache; q, K and V converted to it and the output
    back by F16C where the build has it, as torch rounds: to nearest even)."""
    fused, llm = run(tiny_llama, kv_cache_dtype=cache_dtype)
    runner = llm.llm_engine.executor.local_runner
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {getattr(torch, cache_dtype)}
    assert runner.fast_path is not None  # the C++ decoder ran
    modules, eager = run(tiny_llama, kv_cache_dtype=cache_dtype, enforce_eager=True)
    assert eager.llm_engine.executor.local_runner.fast_path is None
    assert [ids for ids, _ in fused] == [ids for ids, _ in modules]
    assert chosen_logprobs(fused) == chosen_logprobs(modules)  # bit for bit


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", [None, "torch"])  # None: the CPU default, the C++ kernel
def test_a_half_width_cache_keeps_the_fp32_cache_greedy_tokens_by_the_top5_criterion(
    tiny_llama, backend, cache_dtype
):
    """vLLM's criterion: the same tokens, or at the first difference each engine's token in
    the other's top 5; the chosen tokens' logprobs stay within bf16's rounding of K and V."""
    exact, _ = run(tiny_llama, attention_backend=backend)
    half, _ = run(tiny_llama, attention_backend=backend, kv_cache_dtype=cache_dtype)
    for (ids_a, lps_a), (ids_b, lps_b) in zip(exact, half):
        first = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        if first is not None:
            assert ids_b[first] in lps_a[first] and ids_a[first] in lps_b[first]
        same = ids_a if first is None else ids_a[:first]
        for i in range(len(same)):
            assert lps_b[i][ids_b[i]].logprob == pytest.approx(lps_a[i][ids_a[i]].logprob, abs=0.05)


def test_kv_cache_dtype_is_checked_and_takes_vllm_aliases(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), kv_cache_dtype="bf16").create_engine_config()
    assert config.cache.cache_dtype == "bfloat16"
    assert EngineArgs(model=str(tiny_llama)).create_engine_config().cache.cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'int8'"):
        EngineArgs(model=str(tiny_llama), kv_cache_dtype="int8").create_engine_config()
    with pytest.raises(ValueError, match="fp8 caches are not supported"):
        EngineArgs(model=str(tiny_llama), kv_cache_dtype="fp8_e4m3").create_engine_config()

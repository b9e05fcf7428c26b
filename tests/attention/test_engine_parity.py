"""The engine's greedy output matches Hugging Face transformers with each CPU backend."""

from __future__ import annotations

import random

import pytest
from helpers.oracle import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.attention import cpu_kernels


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_hf(model_factory, arch, backend):
    if backend == "cpu" and not cpu_kernels.load():
        pytest.skip("no C++ toolchain")
    model_dir = model_factory(arch)  # mistral: sliding window 24, shorter than the prompts
    rng = random.Random(0)
    shared = [rng.randrange(3, 320) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (1, 9, 40)]
    prompts.append([rng.randrange(3, 320) for _ in range(3)])
    llm = LLM(
        str(model_dir),
        dtype="float32",
        attention_backend=backend,
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=32,
    )
    used = llm.llm_engine.executor.runner.backend
    assert used.name == backend and getattr(used, "_kernel", True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Chunked prefill (32-token budget), prefix-cache hits on the shared 30 tokens, decode.
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(model_dir, prompts, 10)

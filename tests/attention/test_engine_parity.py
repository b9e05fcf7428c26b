"""The engine's greedy output matches Hugging Face transformers with each CPU backend, through
chunked prefill, prefix-cache hits and decode; the default CPU backend runs the C++ kernel."""

from __future__ import annotations

import random

import pytest
from helpers.attention_reference import cpu_has_bf16_dot
from helpers.ci import unavailable
from helpers.logprobs import GreedyOutput, check_logprobs_close, pagedllm_greedy
from helpers.oracle import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.attention import cpu_kernels
from pagedllm.attention.cpu_backend import CpuAttentionBackend

BLOCK = 4
BUDGET = 32  # tokens per step: the 70-token prompt is prefilled in three chunks


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_hf(model_factory, monkeypatch, arch, backend):
    if backend == "cpu" and not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    # The backend's own forward (enforce_eager), not the runner's fused decoder
    # (tests/models/test_fused_decoder.py), which calls the same C++ kernel from C++.
    kernel_calls = count_kernel_calls(monkeypatch)
    model_dir = model_factory(arch)  # mistral: sliding window 24, shorter than the prompts
    rng = random.Random(0)
    shared = [rng.randrange(3, 320) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (40, 1, 9)]
    prompts.append([rng.randrange(3, 320) for _ in range(3)])
    llm = LLM(
        str(model_dir),
        dtype="float32",
        attention_backend=None if backend == "cpu" else backend,  # "cpu": the CPU default
        block_size=BLOCK,
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=BUDGET,
        enforce_eager=True,
    )
    engine = llm.llm_engine
    used = engine.executor.runner.backend
    assert used.name == backend
    assert getattr(used, "uses_kernel", False) == (backend == "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # First the 70-token prompt, prefilled in 32-token chunks, with a short one; then two more
    # prompts that find the shared 30 tokens' 7 full blocks in the prefix cache; decode for all.
    first, then = [prompts[0], prompts[3]], prompts[1:3]
    got = [o.outputs[0].token_ids for o in llm.generate(first, params, use_tqdm=False)]
    assert engine.scheduler.num_prefill_chunks >= -(-len(prompts[0]) // BUDGET) - 1
    got += [o.outputs[0].token_ids for o in llm.generate(then, params, use_tqdm=False)]
    cached = len(shared) // BLOCK * BLOCK
    assert engine.block_manager.prefix_cache_hits == 2 * cached
    want = hf_greedy(model_dir, prompts, 10)
    assert got == [want[0], want[3], want[1], want[2]]
    # the C++ kernel really ran in the "cpu" run, and never in the "torch" one
    assert (kernel_calls[0] > 0) == (backend == "cpu")


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of the C++ kernel from now on (a one-element list)."""
    calls = [0]
    real = cpu_kernels.varlen_attention

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return real(*args, **kwargs)

    # the backend holds the kernel as a class attribute, bound when its module was imported
    monkeypatch.setattr(CpuAttentionBackend, "kernel", staticmethod(counted))
    return calls


def _bf16_llm(model_factory, enable_prefix_caching: bool) -> LLM:
    """A tiny Llama in bf16 with head_dim 32 (the vdpbf16ps path: dim % 32 == 0)."""
    return LLM(
        str(model_factory("llama", head_dim=32)),
        dtype="bfloat16",
        block_size=16,
        kv_cache_memory_bytes=4 << 20,
        enable_prefix_caching=enable_prefix_caching,
    )


def test_decode_over_a_cached_shared_prefix_attends_it_once(model_factory):
    """bf16, six prompts behind one 80-token prefix that an earlier request left in the prefix
    cache: their block tables share its 5 blocks, so each decode step attends that prefix in
    one shared item for all six (the C++ kernel's counter) and merges it with each one's own
    keys. Greedy outputs as the same engine's without the prefix cache (nothing shared), by
    vLLM's criterion (bf16 sums in another order)."""
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    if not cpu_has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 K/V take the vector path, without sets")
    rng = random.Random(1)
    prefix = [rng.randrange(3, 320) for _ in range(80)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 7, 12, 1, 20, 9)]
    outputs = {}
    for caching in (True, False):
        llm = _bf16_llm(model_factory, caching)
        pagedllm_greedy(llm, prefix + [5], 2)  # leaves the prefix's blocks in the cache
        before = cpu_kernels.shared_prefix_items()
        outputs[caching] = greedy_batch(llm, prompts, 12)
        ran = cpu_kernels.shared_prefix_items() - before
        if caching:
            assert llm.llm_engine.block_manager.prefix_cache_hits >= 6 * 80
            assert ran >= 11  # a shared item per decode step (one kv group: six sequences)
        else:
            assert ran == 0
    for a, b in zip(outputs[True], outputs[False], strict=True):
        check_logprobs_close(a, b, ("shared prefix", "no prefix cache"))


def test_prompts_arriving_together_compute_their_shared_prefix_once(model_factory):
    """Six prompts behind one 80-token prefix that nobody has computed yet, submitted together:
    the first computes the prefix's 5 blocks, the other five wait a step for them (the
    scheduler's count) and hit them in the prefix cache, 80 tokens each, rather than all six
    computing it in the same step. Greedy outputs as the same engine's without the prefix
    cache, by vLLM's criterion."""
    rng = random.Random(2)
    prefix = [rng.randrange(3, 320) for _ in range(80)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 7, 12, 1, 20, 9)]
    outputs = {}
    for caching in (True, False):
        llm = _bf16_llm(model_factory, caching)
        outputs[caching] = greedy_batch(llm, prompts, 8)
        engine = llm.llm_engine
        if caching:
            assert engine.block_manager.prefix_cache_hits == 5 * 80
            assert engine.scheduler.num_prefix_waits == 5
        else:
            assert engine.scheduler.num_prefix_waits == 0
    for a, b in zip(outputs[True], outputs[False], strict=True):
        check_logprobs_close(a, b, ("prefix computed once", "no prefix cache"))


def greedy_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[GreedyOutput]:
    """Greedy tokens and each step's top-5 for prompts generated together (decoding at once)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        GreedyOutput(list(o.outputs[0].token_ids), [set(step) for step in o.outputs[0].logprobs])
        for o in outs
    ]

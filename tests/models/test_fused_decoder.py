"""The fused CPU decoder layers (one C++ call for every layer of a step) give exactly the
results of the layers' Python forward: same tokens, same logprobs to the bit, through prefill
chunks, prefix-cache hits and decode, for each architecture, dtype and the int8 path. And they
step aside where they cannot run a layer (torch attention backend, fused ops switched off)."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable
from helpers.generation import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.layers import cpu_fused

CASES = [
    ("llama", "float32", None),
    ("llama", "bfloat16", None),
    ("llama", "float32", "int8"),
    ("llama3_rope", "float32", None),
    ("mistral", "float32", None),  # sliding window shorter than the prompts
    ("qwen2", "float32", None),  # qkv bias
    ("qwen2", "bfloat16", "int8"),  # bias added after the int8 product, in bf16
]


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_fused.load():
        unavailable("the C++ fused ops could not be built")


class FusedCounter:
    """Counts calls of the fused decoder layers; off() makes every forward skip them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self._monkeypatch = monkeypatch
        real = cpu_fused.decoder_layers

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_fused, "decoder_layers", counted)

    def off(self) -> None:
        self._monkeypatch.setenv("PAGEDLLM_CPU_FUSED_DECODER", "0")


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out in outs:
        seq = out.outputs[0]
        chosen = [entry[token].logprob for entry, token in zip(seq.logprobs, seq.token_ids)]
        result.append((seq.token_ids, chosen))
    return result


@pytest.mark.parametrize(("arch", "dtype", "quantization"), CASES)
def test_fused_layers_equal_the_python_layers(
    model_factory, monkeypatch, arch, dtype, quantization
):
    counter = FusedCounter(monkeypatch)
    llm = LLM(
        str(model_factory(arch)),
        dtype=dtype,
        quantization=quantization,
        block_size=4,
        max_num_batched_tokens=32,  # prompts of 20-45 tokens run in chunks
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=1 << 20,
    )
    base = random_prompts(3, 20, 45, seed=3)
    prompts = base + [base[0][:16] + [5, 6, 7]]  # shares four full blocks with the first
    engine = llm.llm_engine
    fused = generate(llm, prompts)
    assert counter.calls > 0
    assert engine.scheduler.num_prefill_chunks > 0
    hits = engine.block_manager.prefix_cache_hits
    assert hits > 0
    engine.block_manager.reset_prefix_cache()
    counter.off()
    calls = counter.calls
    python = generate(llm, prompts)
    assert counter.calls == calls
    assert engine.block_manager.prefix_cache_hits - hits > 0
    assert fused == python  # token ids and logprobs, bit for bit


def test_layers_without_the_cpu_kernel_take_the_python_path(model_factory, monkeypatch):
    counter = FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", attention_backend="torch")
    generate(llm, [[5, 6, 7, 8]])
    assert counter.calls == 0
    for switch in ("PAGEDLLM_CPU_FUSED_DECODER", "PAGEDLLM_CPU_FUSED_OPS"):
        monkeypatch.setenv(switch, "0")
        llm = LLM(str(model_factory("llama")), dtype="float32")
        generate(llm, [[5, 6, 7, 8]])
        assert counter.calls == 0
        monkeypatch.delenv(switch)


def test_replaced_modules_and_caches_are_seen(model_factory, monkeypatch):
    """The operands are kept between steps; replacing a linear module (quantizing a model
    that already ran) or re-allocating the KV cache rebuilds them."""
    from pagedllm.layers.quantization import DynamicQuantConfig

    FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", max_num_seqs=2)
    engine = llm.llm_engine
    model = engine.model.model
    prompt = [[9, 10, 11, 12, 13]]
    generate(llm, prompt)
    first = model._fused_operands[2]
    generate(llm, prompt)
    assert model._fused_operands[2] is first  # kept
    DynamicQuantConfig().apply(engine.model)
    quantized = generate(llm, prompt)
    operands = model._fused_operands[2]
    assert operands is not first
    assert any(t is not None and t.dtype == torch.int8 for t in operands.tensors)
    fresh = LLM(str(model_factory("llama")), dtype="float32", quantization="int8")
    assert generate(fresh, prompt) == quantized
    runner = engine.executor.runner
    runner.allocate_kv_cache(runner.num_blocks)
    generate(llm, prompt)
    assert model._fused_operands[2] is not operands


def test_hooked_layers_run_one_by_one_with_the_same_results(model_factory, monkeypatch):
    """With forward hooks on the layers (the partition profiler times each one) every layer
    is its own fused call, the hooks fire, and nothing else changes."""
    counter = FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", max_num_seqs=2)
    prompts = random_prompts(2, 10, 20, seed=5)
    whole = generate(llm, prompts)
    layers = llm.llm_engine.model.model.layers
    steps = counter.calls
    seen = []
    handles = [layer.register_forward_hook(lambda *_: seen.append(1)) for layer in layers]
    calls = counter.calls
    one_by_one = generate(llm, prompts)
    for h in handles:
        h.remove()
    assert one_by_one == whole
    assert len(seen) == counter.calls - calls == len(layers) * steps

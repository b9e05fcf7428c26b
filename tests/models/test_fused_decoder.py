"""The runner's fused CPU decoder (one C++ call for every layer of a step) gives exactly the
results of the layers' Python modules (enforce_eager=True): same tokens, same logprobs to the
bit, through prefill chunks, prefix-cache hits and decode, for each architecture and layer
variant (q/k norms, offset norms, norms after attention and MLP, GeGLU, per-layer windows and
rotary bases, a query scale), dtype and the int8 path. It is built once, rebuilt only on an
explicit call, and steps aside where it cannot run a layer."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable
from helpers.generation import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.layers import cpu_fused
from pagedllm.layers.quantization import DynamicQuantConfig, GroupKernel, WeightOnlyKernel
from pagedllm.worker.cpu_decoder import CpuFusedDecoder

# int8 x int8 in every linear (the C++ int8 kernel); "int8" and "int4" are the engine's own
# --quantization (the default int8 keeps down_proj weight-only: the weight-only C++ kernel)
W8A8 = DynamicQuantConfig(weight_only_layers=())

CASES = [
    ("llama", "float32", None),
    ("llama", "bfloat16", None),
    ("llama", "float32", "w8a8"),
    ("llama", "float32", "int8"),
    ("llama", "bfloat16", "int4"),
    ("llama3_rope", "float32", None),
    ("mistral", "float32", None),  # sliding window shorter than the prompts
    ("qwen2", "float32", None),  # qkv bias
    ("qwen2", "bfloat16", "w8a8"),  # bias added after the int8 product, in bf16
    ("qwen2", "float32", "int4"),  # bias added after the weight-only product
    ("qwen3", "float32", None),  # per-head q / k norms, explicit head_dim
    ("qwen3", "bfloat16", "w8a8"),
    ("gemma3", "float32", None),  # every Gemma 3 variant, window 8 < the prompts
    ("gemma3", "bfloat16", None),
]


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_fused.load():
        unavailable("the C++ fused ops could not be built")


class FusedCounter:
    """Counts calls of the fused decoder: of its layers alone, and of its layers with the
    model's ends (`head_calls`, which `calls` includes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.head_calls = 0
        layers, with_head = CpuFusedDecoder.__call__, CpuFusedDecoder.logits

        def counted(decoder, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.calls += 1
            return layers(decoder, *args, **kwargs)

        def counted_head(decoder, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.calls += 1
            self.head_calls += 1
            return with_head(decoder, *args, **kwargs)

        monkeypatch.setattr(CpuFusedDecoder, "__call__", counted)
        monkeypatch.setattr(CpuFusedDecoder, "logits", counted_head)


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out in outs:
        seq = out.outputs[0]
        chosen = [entry[token].logprob for entry, token in zip(seq.logprobs, seq.token_ids)]
        result.append((seq.token_ids, chosen))
    return result


def run_engine(
    model_dir: str, dtype: str, quantization: str | None, enforce_eager: bool
) -> tuple[list[tuple[list[int], list[float]]], LLM]:
    llm = LLM(
        model_dir,
        dtype=dtype,
        block_size=4,
        max_num_batched_tokens=32,  # prompts of 20-45 tokens run in chunks
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=1 << 20,
        enforce_eager=enforce_eager,
        quantization=quantization if quantization in ("int8", "int4") else None,
    )
    if quantization == "w8a8":
        W8A8.apply(llm.llm_engine.model)  # rebuilds the fast path: now with int8 products
    base = random_prompts(3, 20, 45, seed=3)
    prompts = base + [base[0][:16] + [5, 6, 7]]  # shares four full blocks with the first
    out = generate(llm, prompts)
    engine = llm.llm_engine
    assert engine.scheduler.num_prefill_chunks > 0
    assert engine.block_manager.prefix_cache_hits > 0
    return out, llm


@pytest.mark.parametrize(("arch", "dtype", "quantization"), CASES)
def test_fused_layers_equal_the_python_layers(
    model_factory, monkeypatch, arch, dtype, quantization
):
    counter = FusedCounter(monkeypatch)
    model_dir = str(model_factory(arch))
    fused, llm = run_engine(model_dir, dtype, quantization, enforce_eager=False)
    assert llm.llm_engine.executor.local_runner.fast_path is not None
    assert counter.calls > 0
    # the final norm and the LM head in the same call, but for a soft-capped head (the tiny
    # Gemma 3's), which compute_logits runs after it
    softcap = llm.llm_engine.model.logit_softcap
    assert (counter.head_calls > 0) == (not softcap)
    calls = counter.calls
    python, eager = run_engine(model_dir, dtype, quantization, enforce_eager=True)
    assert eager.llm_engine.executor.local_runner.fast_path is None
    assert counter.calls == calls  # enforce_eager: the modules ran every step
    assert fused == python  # token ids and logprobs, bit for bit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_joins_the_last_segment_of_a_model_with_two_kv_groups(
    model_factory, monkeypatch, dtype
):
    """Gemma 3 without a soft cap: its sliding and global layers run in several calls (a
    KV cache group each); the final norm and the LM head join the last of them, with the
    modules' results."""
    counter = FusedCounter(monkeypatch)
    model_dir = str(model_factory("gemma3", final_logit_softcapping=None))
    fused, llm = run_engine(model_dir, dtype, None, enforce_eager=False)
    fast_path = llm.llm_engine.executor.local_runner.fast_path
    assert fast_path is not None and len(fast_path.segments) > 1
    assert counter.head_calls > 0
    python, _ = run_engine(model_dir, dtype, None, enforce_eager=True)
    assert fused == python


def test_tokens_the_op_cannot_look_up_are_looked_up_by_the_module(model_factory, monkeypatch):
    """An embedding without a form the op runs (a GGUF file's codes by rows on an AVX2 CPU,
    say): the module looks the tokens up, the layers and the head still run in one call."""
    from pagedllm.layers.embedding import VocabParallelEmbedding

    monkeypatch.setattr(VocabParallelEmbedding, "fused_lookup", lambda self: None)
    counter = FusedCounter(monkeypatch)
    model_dir = str(model_factory("llama"))
    fused, llm = run_engine(model_dir, "float32", None, enforce_eager=False)
    fast_path = llm.llm_engine.executor.local_runner.fast_path
    assert fast_path is not None and len(fast_path.segments) == 1
    assert fast_path.ends is not None and not fast_path.ends.embeds
    assert counter.head_calls > 0
    python, _ = run_engine(model_dir, "float32", None, enforce_eager=True)
    assert fused == python


@pytest.mark.parametrize(("quantization", "bits"), [("int8", {8}), ("int4", {4})])
def test_weight_only_products_run_in_the_fused_decoder(model_factory, quantization, bits):
    """The default int8 (down_proj weight-only int8) and int4 (every linear weight-only)
    build the fused decoder, whose weight-only linears carry -(form + bits) as their level:
    form 128 (x as two int8 parts) where the layer runs int8 activations (in panels on
    AVX512-VNNI, by rows in groups of 32 on AVX2), else 0."""
    from pagedllm.layers import weight_only

    llm = LLM(str(model_factory("llama")), dtype="float32", quantization=quantization)
    runner = llm.llm_engine.executor.local_runner
    assert runner.fast_path is not None
    levels = runner.fast_path.operands.ints
    per_layer = len(levels) // runner.model.config.num_hidden_layers
    linear_levels = [lv for i, lv in enumerate(levels) if 6 <= i % per_layer < 10]
    decoder = runner.model.model.layers
    kernels = [m.quant_kernel for m in decoder.modules() if hasattr(m, "quant_kernel")]
    packed = [k.packed for k in kernels if isinstance(k, WeightOnlyKernel | GroupKernel)]
    forms = {128 if weight_only.int8_activations_run(p) else 0 for p in packed}
    assert len(forms) == 1
    assert {-lv for lv in linear_levels if lv < 0} == {forms.pop() + b for b in bits}
    if quantization == "int8":
        assert any(lv > 0 for lv in linear_levels)  # qkv / o / gate_up stay W8A8


def test_layers_without_the_cpu_kernel_take_the_python_path(model_factory, monkeypatch):
    counter = FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", attention_backend="torch")
    generate(llm, [[5, 6, 7, 8]])
    assert counter.calls == 0
    for switch in ("PAGEDLLM_CPU_FUSED_DECODER", "PAGEDLLM_CPU_FUSED_OPS"):
        monkeypatch.setenv(switch, "0")  # read once, by create_engine_config
        llm = LLM(str(model_factory("llama")), dtype="float32")
        monkeypatch.delenv(switch)
        generate(llm, [[5, 6, 7, 8]])
        assert counter.calls == 0
        assert llm.llm_engine.executor.local_runner.fast_path is None


def test_the_fast_path_changes_only_on_an_explicit_rebuild(model_factory, monkeypatch):
    """Built once with the KV cache; quantizing a model that already ran rebuilds it (apply
    calls the runner's rebuild_fast_path); re-allocating the KV cache rebuilds it."""
    FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", max_num_seqs=2)
    engine = llm.llm_engine
    runner = engine.executor.local_runner
    prompt = [[9, 10, 11, 12, 13]]
    generate(llm, prompt)
    first = runner.fast_path
    generate(llm, prompt)
    assert runner.fast_path is first  # kept between steps
    W8A8.apply(engine.model)  # calls the runner's rebuild_fast_path
    assert runner.fast_path is not first
    quantized = generate(llm, prompt)
    operands = runner.fast_path.operands
    assert any(t is not None and t.dtype == torch.int8 for t in operands.tensors)
    fresh = LLM(str(model_factory("llama")), dtype="float32", enforce_eager=True)
    W8A8.apply(fresh.llm_engine.model)
    assert generate(fresh, prompt) == quantized  # the modules, quantized the same way
    current = runner.fast_path
    runner.allocate_kv_cache(runner.num_blocks)
    generate(llm, prompt)
    assert runner.fast_path is not current


def test_layer_by_layer_calls_every_layer_with_the_same_results(model_factory, monkeypatch):
    """runner.forward(layer_by_layer=True) (the partition profiler's per-layer timers) calls
    each layer module, so its forward hooks fire, and computes the same hidden states."""
    counter = FusedCounter(monkeypatch)
    llm = LLM(str(model_factory("llama")), dtype="float32", max_num_seqs=2)
    engine = llm.llm_engine
    runner = engine.executor.local_runner
    engine.add_request("a", {"prompt_token_ids": random_prompts(1, 10, 20, seed=5)[0]})
    inp = runner.prepare_input(engine.scheduler.schedule())
    seen = []
    layers = runner.model.model.layers
    handles = [layer.register_forward_hook(lambda *_: seen.append(1)) for layer in layers]
    fused = runner.forward(inp)
    assert counter.calls == 1 and not seen
    by_layer = runner.forward(inp, layer_by_layer=True)  # rewrites the same K/V slots
    for h in handles:
        h.remove()
    assert counter.calls == 1
    assert len(seen) == len(layers)
    assert torch.equal(fused, by_layer)

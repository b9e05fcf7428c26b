"""SmolLM2-135M-Instruct's GGUF file (Q4_1) against transformers' own GGUF loading.

transformers reads the same file (``from_pretrained(folder, gguf_file=...)``); the fp32 folder
of helpers.real_model is what it loads, saved. Prompts are short and outputs a few tokens, so
the module runs in well under a minute on two cores.
"""

from __future__ import annotations

import pytest
import torch
from helpers.logprobs import check_logprobs_close, hf_greedy_top, pagedllm_greedy
from helpers.real_model import smollm2_gguf, smollm2_hf_folder
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.hf_config import read_hf_config
from pagedllm.models.sources import open_source
from pagedllm.worker.cpu_decoder import CpuFusedDecoder

STRINGS = [
    "What is the capital of France?",
    "  leading spaces,   runs of them\n\n\tand tabs ",
    "héllo wörld — ünïcödé 日本語 한국어 🤖🙂",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"key": [1, 2.5, null], "s": "a\\nb"}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|>more<repo_name>",
    "1234567890 3.14159 1e-9",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another 🙂?"},
    ],
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?"]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(model=str(gguf_path), kv_cache_memory_bytes=64 << 20, max_model_len=512)


def test_config_and_weights_equal_transformers_gguf_loading(gguf_path):
    folder = smollm2_hf_folder()
    ours = open_source(gguf_path).read_config()
    theirs = read_hf_config(folder)
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    state = load_file(str(folder / "model.safetensors"))
    loaded = dict(open_source(gguf_path).iterate_weights(torch.float32))
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name]), name


def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_path, hf_tokenizer):
    ours = load_tokenizer(str(gguf_path))
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
            ids, skip_special_tokens=True
        ), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(hf_tokenizer, name), name
    assert len(ours) == len(hf_tokenizer)


def test_chat_template_renders_like_transformers(gguf_path, hf_tokenizer):
    ours = load_tokenizer(str(gguf_path))
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            kw = dict(add_generation_prompt=prompt)
            text = ours.apply_chat_template(conversation, tokenize=False, **kw)
            assert text == hf_tokenizer.apply_chat_template(conversation, tokenize=False, **kw)
            assert ours.apply_chat_template(conversation, **kw) == list(
                hf_tokenizer.apply_chat_template(conversation, **kw, return_dict=False)
            )


def _chat_prompts_matched(llm, hf, hf_tokenizer, names: tuple[str, str]) -> list[int]:  # noqa: ANN001
    """Each chat prompt's 12 greedy tokens from both under the top-5 criterion (raising where
    it fails): how many match before the first difference."""
    matched = []
    for question in CHAT_PROMPTS:
        conversation = [{"role": "user", "content": question}]
        ids = list(
            hf_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, return_dict=False
            )
        )
        ours = pagedllm_greedy(llm, ids, max_tokens=12)
        theirs = hf_greedy_top(hf, ids, max_tokens=12)
        matched.append(check_logprobs_close(ours, theirs, names))
    return matched


def test_greedy_chat_matches_transformers_under_the_top5_criterion(llm, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_folder(), dtype=torch.float32)
    matched = _chat_prompts_matched(llm, hf, hf_tokenizer, ("pagedllm", "transformers"))
    assert sum(matched) >= len(CHAT_PROMPTS) * 6, matched  # mostly equal, not just close


def test_bf16_decode_matches_transformers_bf16_under_the_top5_criterion(hf_tokenizer, monkeypatch):
    """The folder in bf16: decode steps run bf16 one-row products (the C++ GEMV, or the panels
    where the CPU has AVX-512; the LM head's counted here) against transformers in bf16, under
    the same criterion."""
    from transformers import AutoModelForCausalLM

    from pagedllm.layers import cpu_fused, panel_gemm

    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_folder(), dtype=torch.bfloat16)
    llm = LLM(model=str(smollm2_hf_folder()), dtype="bfloat16", kv_cache_memory_bytes=32 << 20,
              max_model_len=512)  # fmt: skip
    head_rows = []
    fast_path = llm.llm_engine.executor.local_runner.fast_path
    if fast_path is not None and fast_path.ends is not None:  # the head in the layers' call
        weight = fast_path.ends.head[0]
        assert weight is llm.llm_engine.model.lm_head.weight_panels or weight.dim() == 2
        real = CpuFusedDecoder.logits
        monkeypatch.setattr(
            CpuFusedDecoder,
            "logits",
            lambda self, *a: head_rows.append(weight.dtype) or real(self, *a),
        )
    else:
        in_panels = llm.llm_engine.model.lm_head.weight_panels is not None
        module, name = (panel_gemm, "linear") if in_panels else (cpu_fused, "gemv")
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda x, w, b, **kw: head_rows.append(x.dtype) or real(x, w, b, **kw)
        )
    matched = _chat_prompts_matched(llm, hf, hf_tokenizer, ("pagedllm bf16", "transformers bf16"))
    assert head_rows and set(head_rows) == {torch.bfloat16}
    assert sum(matched) >= len(CHAT_PROMPTS) * 6, matched


def test_chat_answers_the_capital_of_france(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_bursts_of_decode_steps_give_the_chat_answers_of_one_step_a_schedule(llm, gguf_path):
    """num_scheduler_steps=8 on the real file: the three chat answers, ended by the model's
    EOS or max_tokens, are the tokens one step a schedule gives, and bursts ran."""
    bursts = LLM(
        model=str(gguf_path), kv_cache_memory_bytes=64 << 20, max_model_len=512,
        num_scheduler_steps=8,
    )  # fmt: skip
    conversations = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.outputs[0] for o in llm.chat(conversations, params, use_tqdm=False)]
    got = [o.outputs[0] for o in bursts.chat(conversations, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert {o.finish_reason for o in got} == {"stop", "length"}  # EOS inside the batch's bursts
    assert "Paris" in got[0].text
    assert bursts.llm_engine.executor.local_runner.num_decode_bursts > 0


def test_converted_folder_loads_and_decodes_like_the_gguf(llm, hf_tokenizer):
    """The transformers folder made from the file holds the same fp32 weights: the engine
    decodes it exactly as it decodes the GGUF."""
    folder_llm = LLM(
        model=str(smollm2_hf_folder()), kv_cache_memory_bytes=64 << 20, max_model_len=512
    )
    conversation = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    ids = list(
        hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, return_dict=False
        )
    )
    assert (
        folder_llm.get_tokenizer().encode(hf_tokenizer.decode(ids), add_special_tokens=False) == ids
    )
    a = pagedllm_greedy(folder_llm, ids, max_tokens=10)
    b = pagedllm_greedy(llm, ids, max_tokens=10)
    assert a.token_ids == b.token_ids


def test_q4_1_file_is_served_in_its_blocks(llm, gguf_path):
    """The file's Q4_1 linears and its Q8_0 embedding (the tied LM head) stay in their blocks:
    the model holds about the file's bytes, and the fused decoder runs the int4 products."""
    from pagedllm.layers.quantization import describe, weight_bytes

    model = llm.llm_engine.model
    assert describe(model).startswith(
        "120 int4 weight-only, group 32, 2 int8 weight-only, group 32"
    )  # qkv, o, gate_up, down of 30 layers; embedding and head share the Q8_0 codes
    assert model.lm_head.weight_packed is model.model.embed_tokens.weight_packed
    size = gguf_path.stat().st_size
    if model.model.layers[0].mlp.down_proj.weight_group_scale.dtype == torch.float16:
        assert 0.95 * size < weight_bytes(model) <= size  # in panels: the blocks' own bytes
    else:  # the row layout's kernel: fp32 group constants
        assert size < weight_bytes(model) < size * 1.25
    levels = llm.llm_engine.executor.local_runner.fast_path.operands.ints
    from pagedllm.layers import panel_gemm, weight_only

    # The first layer's four linears, int4; with x rounded to int8 (-(64 + 4)) where the CPU
    # runs int8 activations (in panels on AVX512-VNNI, by rows on AVX2).
    int8_x = weight_only.int8_activations()
    int4 = -68 if int8_x else -4
    assert levels[6:10] == [int4] * 4
    # the head's x as two int8 parts (within 3e-5 of fp32 x) there, fp32 elsewhere
    head = "int8_residual" if int8_x else "float"
    assert model.lm_head.quant_kernel.x_form == head
    assert model.model.layers[0].mlp.down_proj.quant_kernel.x_form == (
        "int8" if int8_x else "float"
    )

    if panel_gemm.quantized_available():  # AVX-512: every packed weight in panels, one each
        packed = [m.packed for m in (model.model.layers[0].mlp.down_proj.quant_kernel,
                                     model.lm_head.quant_kernel)]  # fmt: skip
        assert all(p.panels and p.qweight.dim() == 3 for p in packed)
        assert model.model.embed_tokens.packed is model.lm_head.quant_kernel.packed


def test_quantization_none_dequantizes_the_file(gguf_path):
    from pagedllm.layers.quantization import describe, weight_bytes

    llm = LLM(model=str(gguf_path), quantization="none", dtype="bfloat16",
              kv_cache_memory_bytes=16 << 20, max_model_len=256)  # fmt: skip
    model = llm.llm_engine.model
    assert describe(model) == "no layer quantized"
    assert weight_bytes(model) > 2 * gguf_path.stat().st_size  # bf16 values
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF file"):
        LLM(model=str(smollm2_hf_folder()), quantization="gguf")

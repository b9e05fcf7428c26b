"""GGUF files as model sources: config from metadata, tensors under Hugging Face names.

Files are written by helpers.gguf_files the way llama.cpp's converter writes them (names,
Llama's interleaved q/k rows, Gemma's 1 + w norms, block types) from tiny random Hugging Face
models; the original model is the oracle for F32 files, transformers' own GGUF loading and
gguf's dequantize for quantized ones.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from helpers.gguf_files import write_model_gguf, write_raw_tensor_gguf
from helpers.int8_activations import panels_on_vnni
from helpers.models import build_tokenizer
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.gguf_metadata import open_gguf
from pagedllm.hf_config import read_hf_config
from pagedllm.layers import panel_gemm
from pagedllm.layers.panel_gemm import unpack
from pagedllm.models.gguf_loader import iterate_gguf_tensors
from pagedllm.models.sources import GGUFSource, open_source

_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
# Hugging Face model_type -> (GGUF architecture, extra config fields)
_ARCHS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "gemma3_text": (
        "gemma3",
        dict(tie_word_embeddings=True, head_dim=32, sliding_window=16, query_pre_attn_scalar=32),
    ),
}
_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
VNNI = panels_on_vnni()


def tiny_hf(
    folder: Path,
    model_type: str,
    seed: int = 0,
    layer_types: list[str] | None = None,
    **overrides: object,
) -> Path:
    """A tiny random transformers model of model_type, saved with a byte-level tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = _TINY | _ARCHS[model_type][1] | overrides
    config = AutoConfig.for_model(model_type, **kwargs)
    if model_type == "gemma3_text":
        # llama.cpp's Gemma 3 layout unless told: every sixth layer global
        config.layer_types = layer_types or [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)
        ]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(folder))
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[tuple, tuple[Path, Path]] = {}

    def make(model_type: str, tensor_type=None, **overrides: object) -> tuple[Path, Path]:
        key = (model_type, tensor_type, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tiny_hf(tmp_path_factory.mktemp(model_type), model_type, **overrides)
            kind = None if tensor_type is None else (lambda name, values: tensor_type)
            arch = _ARCHS[model_type][0]
            made[key] = folder, write_model_gguf(folder, folder / "model.gguf", arch, kind)
        return made[key]

    return make


@pytest.mark.parametrize("model_type", list(_ARCHS))
def test_config_has_the_fields_of_the_models_config_json(tiny, model_type):
    folder, gguf_path = tiny(model_type)
    ours = open_source(gguf_path).read_config()
    hf = read_hf_config(folder)
    for name in _CONFIG_FIELDS:
        assert getattr(ours, name, None) == pytest.approx(getattr(hf, name, None)), name
    assert ours.architectures == hf.architectures
    assert ours.rope_parameters == hf.rope_parameters
    if model_type == "gemma3_text":
        assert ours.layer_types == hf.layer_types
        assert ours.sliding_window == hf.sliding_window
        assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_config_matches_transformers_gguf_config(tiny, model_type):
    from transformers import AutoConfig

    _, gguf_path = tiny(model_type)
    theirs = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = open_source(gguf_path).read_config()
    for name in _CONFIG_FIELDS:
        assert getattr(ours, name, None) == pytest.approx(getattr(theirs, name, None)), name


@pytest.mark.parametrize("model_type", list(_ARCHS))
def test_f32_weights_are_the_hf_weights_exactly(tiny, model_type):
    """Names mapped back, Llama's q/k rows restored, Gemma's norm offset removed: every
    tensor equals the original one bit for bit."""
    folder, gguf_path = tiny(model_type)
    state = load_file(str(folder / "model.safetensors"))
    loaded = dict(open_source(gguf_path).iterate_weights(torch.float32))
    assert set(loaded) == set(state)
    for name, want in state.items():
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            # stored as 1 + w in float32: w comes back within float32 rounding of 1 + w
            torch.testing.assert_close(loaded[name], want, rtol=0, atol=2**-23)
            assert not torch.equal(loaded[name] + 1, want + 1 + 1e-3)
        else:
            assert torch.equal(loaded[name], want), name


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_weights_dequantize_as_gguf_does(tiny, kind):
    folder, gguf_path = tiny("llama", kind)
    state = load_file(str(folder / "model.safetensors"))
    loaded = dict(open_source(gguf_path).iterate_weights(torch.float32))
    q = state["model.layers.1.self_attn.q_proj.weight"].numpy()
    # the reference: quantize the HF rows, dequantize them with gguf
    want = dequantize(quantize(q, kind), kind).reshape(q.shape)
    assert torch.equal(loaded["model.layers.1.self_attn.q_proj.weight"], torch.from_numpy(want))
    for name, tensor in loaded.items():
        assert tensor.shape == state[name].shape
        assert (tensor - state[name]).abs().max() < 0.25, name  # Q4 error on N(0, 0.2)


def test_weights_equal_transformers_gguf_loading(tiny):
    from transformers import AutoModelForCausalLM

    _, gguf_path = tiny("llama", Q.Q4_1)
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = dict(open_source(gguf_path).iterate_weights(torch.float32))
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_weights_come_in_the_requested_dtype(tiny):
    _, gguf_path = tiny("llama", Q.Q8_0)
    dtypes = {t.dtype for _, t in open_source(gguf_path).iterate_weights(torch.bfloat16)}
    assert dtypes == {torch.bfloat16}


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL])
def test_k_quant_blocks_dequantize_and_stay_reachable(tmp_path, kind):
    """Block types gguf can only dequantize: random blocks (finite f16 scales: every byte
    below 0x3c) come back as gguf's dequantize gives them, in Hugging Face row order."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    rows, cols = 8, 256
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)
    path = write_raw_tensor_gguf(
        tmp_path / "k.gguf", "qwen2", {"blk.0.ffn_down.weight": (blocks, kind)}
    )
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    (tensor,) = iterate_gguf_tensors(open_gguf(path), config)
    assert tensor.name == "model.layers.0.mlp.down_proj.weight" and tensor.ggml_type == kind
    assert tensor.shape == (rows, cols)
    assert np.array_equal(tensor.blocks(), blocks)
    want = torch.from_numpy(dequantize(blocks, kind).reshape(rows, cols))
    assert torch.equal(tensor.dequantize(torch.float32), want)


def test_raw_blocks_of_llama_q_rows_are_in_hf_order(tiny):
    """The quantized rows a kernel would keep are permuted like the values: dequantizing
    blocks() gives the Hugging Face rows."""
    folder, gguf_path = tiny("llama", Q.Q8_0)
    tensors = {t.name: t for t in GGUFSource(gguf_path).iterate_tensors()}
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    want = load_file(str(folder / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    assert k.blocks().shape == (want.shape[0], want.shape[1] // 32 * 34)
    assert np.array_equal(k.blocks(), quantize(want.numpy(), Q.Q8_0))


def test_a_file_without_output_weight_ties_the_head(tiny, tmp_path):
    folder, gguf_path = tiny("llama")
    assert open_source(gguf_path).read_config().tie_word_embeddings is False
    tied = write_model_gguf(folder, tmp_path / "tied.gguf", "llama", drop=("lm_head.weight",))
    config = open_source(tied).read_config()
    assert config.tie_word_embeddings is True
    llm = LLM(model=str(tied), kv_cache_memory_bytes=1 << 20)
    model = llm.llm_engine.executor.runner.model
    embed = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    head = model.lm_head
    assert head.weight is model.model.embed_tokens.weight  # tied (in panels: the placeholder)
    weight = head.weight if head.weight_panels is None else unpack(head.weight_panels)
    assert torch.equal(weight, embed)


def test_llm_on_a_gguf_file_decodes_like_transformers(tiny):
    """LLM(model='x.gguf') end to end: the file's tokenizer, config and weights; greedy
    output equals transformers' on the original folder token for token."""
    from transformers import AutoModelForCausalLM

    folder, gguf_path = tiny("llama")
    llm = LLM(model=str(gguf_path), kv_cache_memory_bytes=1 << 20)
    prompt = "The quick brown fox"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = out[0].prompt_token_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert list(out[0].outputs[0].token_ids) == want[0, len(ids) :].tolist()


def test_engine_args_take_a_gguf_model_and_a_tokenizer_override(tiny):
    folder, gguf_path = tiny("llama")
    config = EngineArgs(model=str(gguf_path), tokenizer=str(folder)).create_engine_config()
    assert config.model.model == str(gguf_path) and config.model.tokenizer == str(folder)
    assert config.model.architecture == "LlamaForCausalLM"
    assert config.model.hf_config.num_hidden_layers == 2


def test_unsupported_architecture_and_non_gguf_files_are_clear_errors(tmp_path):
    path = write_raw_tensor_gguf(
        tmp_path / "mamba.gguf", "mamba", {"x.weight": (np.zeros((1, 34), np.uint8), Q.Q8_0)}
    )
    with pytest.raises(ValueError, match="architecture 'mamba'.*supported GGUF architectures"):
        EngineArgs(model=str(path)).create_engine_config()
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        EngineArgs(model=str(other)).create_engine_config()
    with pytest.raises(ValueError, match="not a local folder or file"):
        EngineArgs(model=str(tmp_path / "missing.gguf")).create_engine_config()


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3 scaling as per-frequency factors (rope_freqs.weight)."""
    from pagedllm.gguf_metadata import _llama3_factors

    folder = tiny_hf(
        tmp_path,
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rope_theta=500000.0,
        max_position_embeddings=131072,
        head_dim=64,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    hf = read_hf_config(folder)
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    factors = _llama3_factors(inv_freq, hf.rope_parameters)
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the scaling
    path = write_model_gguf(
        folder, tmp_path / "l3.gguf", "llama", extra={"rope_freqs.weight": factors}
    )
    assert open_source(path).read_config().rope_parameters == hf.rope_parameters
    names = dict(open_source(path).iterate_weights(torch.float32))
    assert set(names) == set(load_file(str(folder / "model.safetensors")))
    unknown = write_model_gguf(
        folder, tmp_path / "l3x.gguf", "llama", extra={"rope_freqs.weight": factors**0.5}
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        open_source(unknown).read_config()


def test_tensor_parallel_ranks_load_their_shards_from_the_file(tiny):
    """TP=2: each worker process opens the file itself and loads its shard of the
    dequantized (and, for q/k, row-restored) tensors: greedy output equals TP=1's."""
    _, gguf_path = tiny("llama", Q.Q8_0)
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = dict(kv_cache_memory_bytes=1 << 20, enforce_eager=True)
    tp1 = LLM(model=str(gguf_path), **base)
    want = tp1.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    tp2 = LLM(model=str(gguf_path), tensor_parallel_size=2, **base)
    try:
        got = tp2.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        tp2.llm_engine.shutdown()
    assert list(got) == list(want)


def test_gemma3_layer_pattern_stored_in_the_file_is_read(tmp_path):
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    folder = tiny_hf(tmp_path, "gemma3_text", num_hidden_layers=3, layer_types=types)
    path = write_model_gguf(folder, tmp_path / "g.gguf", "gemma3")
    config = open_source(path).read_config()
    assert config.layer_types == read_hf_config(folder).layer_types == types


@pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI / VBMI on this CPU: GGUF blocks by rows")
@pytest.mark.parametrize("enforce_eager", [False, True])  # the fused decoder, the modules
def test_a_decode_step_of_six_sequences_rounds_every_row_to_int8(tiny, enforce_eager):
    """A GGUF file's layers round a decode step's x to int8 at any row count ("int8_decode",
    llama.cpp's numerics for one decoding sequence), where past 4 rows x stayed float, and
    keep a prompt's rows past 4 float: six sequences' 5 decode steps through 2 layers of 4
    products are 6 x 5 x 8 int8 rows; their prompts (81 rows) add none, nor does the LM
    head (x as two int8 parts at one row only)."""
    _, gguf_path = tiny("llama", Q.Q4_1)
    llm = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory_bytes=1 << 20,
              enforce_eager=enforce_eager)  # fmt: skip
    layer = llm.llm_engine.executor.runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight_packed.dim() == 3  # the codes in panels
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j) % 300 + 3 for j in range(6 + 3 * i)]}
               for i in range(6)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    start = panel_gemm.int8_rows()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 6
    assert panel_gemm.int8_rows() - start == 6 * 5 * 2 * 4


@pytest.mark.parametrize(
    "kind,dtype",
    [(None, "float32"), (Q.F16, "float16"), (Q.BF16, "bfloat16"), (Q.Q8_0, None), (Q.Q4_1, None)],
)
def test_a_files_float_matrices_give_its_config_dtype_and_auto_follows_it(
    tiny, monkeypatch, kind, dtype
):
    """A converter's f32 / f16 / bf16 file declares its matrices' dtype, as config.json's
    torch_dtype does; a quantized one none. dtype="auto" then runs a bf16 file in bfloat16
    where the CPU multiplies it natively (float32 elsewhere), a quantized one in float32."""
    from pagedllm import config as config_module

    _, gguf_path = tiny("llama", kind)
    assert open_source(gguf_path).read_config().torch_dtype == dtype
    for native in (True, False):
        monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda native=native: native)
        resolved = EngineArgs(model=str(gguf_path), device="cpu").create_engine_config().model
        half = dtype in ("float16", "bfloat16")  # on the CPU: bfloat16 where native
        want = ("bfloat16" if native else "float32") if half else "float32"
        assert resolved.dtype == want, (native, dtype)

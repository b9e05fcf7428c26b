"""The fused CPU decoder on tiny single layers, one declared variant at a time: the same
hidden states, residual and KV cache, bit for bit, as the layer's own modules."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers.ci import unavailable

from pagedllm.attention import cpu_kernels
from pagedllm.attention.backend import get_attention_backend
from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.layers import cpu_fused
from pagedllm.layers.decoder_spec import DecoderLayerSpec
from pagedllm.models.llama import LlamaDecoderLayer
from pagedllm.worker.cpu_decoder import CpuFusedDecoder

CONFIG = SimpleNamespace(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads x head_dim = 128, not the hidden size
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
BASE = DecoderLayerSpec(eps=1e-6, scale=32**-0.5)
VARIANTS = {
    "llama": BASE,
    "qk_norm": dataclasses.replace(BASE, qk_norm=True),
    "offset_norm": dataclasses.replace(BASE, norm_offset=True),
    "post_attention_norm": dataclasses.replace(BASE, post_attention_norm=True),
    "post_mlp_norm": dataclasses.replace(BASE, post_attention_norm=True, post_mlp_norm=True),
    "gelu_tanh": dataclasses.replace(BASE, activation="gelu_tanh"),
    "window": dataclasses.replace(BASE, window_left=3),
    "query_scale": dataclasses.replace(BASE, scale=0.3),
    "gemma3": DecoderLayerSpec(
        eps=1e-6,
        scale=24**-0.5,
        window_left=5,
        norm_offset=True,
        qk_norm=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        activation="gelu_tanh",
    ),  # fmt: skip
}
BLOCK = 4


@pytest.fixture(autouse=True)
def kernels() -> None:
    if not (cpu_fused.load() and cpu_kernels.load()):
        unavailable("the C++ fused ops or attention kernel could not be built")


def make_layer(spec: DecoderLayerSpec, dtype: torch.dtype, seed: int) -> LlamaDecoderLayer:
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(CONFIG, 0, spec, dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(0.2 * torch.randn_like(p, dtype=torch.float32))
    return layer


def bind_cache(layer: LlamaDecoderLayer, dtype: torch.dtype, blocks: int) -> None:
    attn = layer.self_attn.attn
    shape = (blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
    attn.key_cache, attn.value_cache = (
        torch.zeros(shape, dtype=dtype),
        torch.zeros(shape, dtype=dtype),
    )
    attn.backend = get_attention_backend("cpu", torch.device("cpu"))


def step(query_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of a step: sequence i owns blocks [8 i, 8 i + 8)."""
    positions, slots = [], []
    for i, (n, total) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(total - n, total)
        positions.append(pos)
        slots.append((8 * i + pos // BLOCK) * BLOCK + pos % BLOCK)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.stack([torch.arange(8 * i, 8 * i + 8) for i in range(len(query_lens))])
    md = AttentionMetadata.paged(
        query_start_loc=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        slot_mapping=torch.cat(slots),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return torch.cat(positions), md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_layer_equals_the_modules(variant, dtype):
    spec = VARIANTS[variant]
    modules, fused = make_layer(spec, dtype, 0), make_layer(spec, dtype, 0)
    for layer in (modules, fused):
        bind_cache(layer, dtype, blocks=16)
    decoder = CpuFusedDecoder.build(torch.nn.ModuleList([fused]), dtype)
    assert decoder is not None
    # a prefill of two prompts (11 and 7 tokens), then a decode step of both
    for query_lens, seq_lens in (([11, 7], [11, 7]), ([1, 1], [12, 8])):
        positions, md = step(query_lens, seq_lens)
        hidden = torch.randn(sum(query_lens), CONFIG.hidden_size).to(dtype)
        with torch.inference_mode(), ForwardContext(md):
            want, want_res = modules(positions, hidden, None)
            got, got_res = decoder(hidden, positions, md)
        assert torch.equal(got, want) and torch.equal(got_res, want_res)
    attn_m, attn_f = modules.self_attn.attn, fused.self_attn.attn
    assert torch.equal(attn_m.key_cache, attn_f.key_cache)
    assert torch.equal(attn_m.value_cache, attn_f.value_cache)


def test_a_layer_the_op_cannot_run_is_refused():
    """The torch attention backend: no fused decoder (the runner then runs the modules)."""
    layer = make_layer(BASE, torch.float32, 0)
    bind_cache(layer, torch.float32, blocks=4)
    layer.self_attn.attn.backend = get_attention_backend("torch", torch.device("cpu"))
    layers = torch.nn.ModuleList([layer])
    assert CpuFusedDecoder.build(layers, torch.float32) is None
    assert "torch" in CpuFusedDecoder.why_not(layers, torch.float32)

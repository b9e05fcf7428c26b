"""Qwen3: the Llama blocks with a per-head RMSNorm on q and k, an explicit head_dim and no
qkv bias (models/llama.py builds all of it from the layer declaration)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.layers.decoder_spec import DecoderLayerSpec
from pagedllm.models.llama import LlamaForCausalLM, llama_layer_spec


def qwen3_layer_spec(c: Any, layer_idx: int) -> DecoderLayerSpec:
    return dataclasses.replace(llama_layer_spec(c, layer_idx), qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_spec = staticmethod(qwen3_layer_spec)

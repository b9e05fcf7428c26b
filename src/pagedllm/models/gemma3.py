"""Gemma 3 text (Gemma3ForCausalLM) on the Llama blocks, as its layers declare them.

Local sliding-window layers interleaved with global ones (``layer_types``), each kind with
its rotary base; per-head q / k norms; norms before and after attention and the MLP, all
offset RMSNorms ``x * (1 + w)``; GeGLU with tanh GELU; embeddings scaled by
sqrt(hidden_size); queries scaled by query_pre_attn_scalar ** -0.5; tied embeddings and an
optional final logit soft cap (models/llama.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.layers.decoder_spec import DecoderLayerSpec
from pagedllm.layers.rotary import rope_parameters
from pagedllm.models.llama import LlamaForCausalLM, layer_type, window_left

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def gemma3_layer_spec(c: Any, layer_idx: int) -> DecoderLayerSpec:
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported (gelu_pytorch_tanh).")
    if getattr(c, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported; Gemma 3 configs leave it None.")
    theta, _ = rope_parameters(c, layer_type(c, layer_idx))
    return DecoderLayerSpec(
        eps=c.rms_norm_eps,
        scale=float(c.query_pre_attn_scalar) ** -0.5,
        window_left=window_left(c, layer_idx),
        rope_theta=theta,
        norm_offset=True,
        qk_norm=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        activation=_ACTIVATIONS[act],
    )


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_spec = staticmethod(gemma3_layer_spec)

    def embed_scale_for(self, hf_config: Any) -> float | None:
        return float(hf_config.hidden_size) ** 0.5

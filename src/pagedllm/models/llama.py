"""The Llama family: Llama, Mistral (sliding window) and Qwen2 (qkv bias, tied embeddings),
and the building blocks Qwen3 and Gemma 3 share (models/qwen3.py, models/gemma3.py).

The model works on a flat batch of tokens ([num_tokens] ids and positions); which sequence
each token belongs to lives in the attention metadata, not in the tensors' shapes. Each
decoder layer is built from its :class:`DecoderLayerSpec` (``layer_spec``), the declaration
the runner's fused CPU decoder executes; how a step runs is the runner's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.config import head_dim, num_kv_heads
from pagedllm.layers.activation import ACTIVATIONS
from pagedllm.layers.attention import Attention
from pagedllm.layers.decoder_spec import DecoderLayerSpec
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import PlainRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters

# (positions, hidden, residual, reduce) -> (hidden, residual); reduce=False leaves the
# row-parallel partial sums for the caller to all-reduce (communication overlap).
Stage = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def layer_type(hf_config: Any, layer_idx: int) -> str | None:
    """ "sliding_attention" | "full_attention" where the config lists layer_types."""
    types = getattr(hf_config, "layer_types", None)
    return None if types is None else types[layer_idx]


def window_left(hf_config: Any, layer_idx: int) -> int:
    """Keys a layer's queries may look back (flash-attn's window_size[0]); -1 = unlimited."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return -1
    kind = layer_type(hf_config, layer_idx)
    if kind is not None:
        return window - 1 if kind == "sliding_attention" else -1
    if getattr(hf_config, "use_sliding_window", True) is False:
        return -1
    return window - 1


def llama_layer_spec(c: Any, layer_idx: int) -> DecoderLayerSpec:
    theta, _ = rope_parameters(c, layer_type(c, layer_idx))
    return DecoderLayerSpec(
        eps=c.rms_norm_eps,
        scale=head_dim(c) ** -0.5,
        window_left=window_left(c, layer_idx),
        rope_theta=theta,
    )


class LlamaAttention(nn.Module):
    def __init__(self, c: Any, layer_idx: int, spec: DecoderLayerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        dim = head_dim(c)
        bias = getattr(c, "attention_bias", False) or c.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size, dim, c.num_attention_heads, num_kv_heads(c), bias=bias, dtype=dtype
        )
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = heads * dim, kv_heads * dim
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * dim,
            c.hidden_size,
            bias=getattr(c, "o_proj_bias", False),
            dtype=dtype,
        )
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = PlainRMSNorm(dim, spec.eps, dtype, spec.norm_offset)
            self.k_norm = PlainRMSNorm(dim, spec.eps, dtype, spec.norm_offset)
        theta, scaling = rope_parameters(c, layer_type(c, layer_idx))
        self.rotary_emb = RotaryEmbedding(dim, c.max_position_embeddings, theta, scaling, dtype)
        self.attn = Attention(heads, kv_heads, dim, spec.scale, spec.window_left)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, reduce: bool = True
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens, dim = hidden.shape[0], self.attn.head_dim
        q, k = q.view(num_tokens, -1, dim), k.view(num_tokens, -1, dim)  # [T, heads, dim]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v), reduce)


class LlamaMLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up in one product."""

    def __init__(self, c: Any, spec: DecoderLayerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        size = c.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [size, size], dtype=dtype)
        self.down_proj = RowParallelLinear(size, c.hidden_size, dtype=dtype)
        self.act_fn = ACTIVATIONS[spec.activation](dtype)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)), reduce)


class LlamaDecoderLayer(nn.Module):
    """Norm, attention, (norm), residual; norm, MLP, (norm), residual: as ``spec`` declares.

    Checkpoint names: Llama's pre-MLP norm is ``post_attention_layernorm``; a layer with a
    norm after attention (Gemma) calls that one so and its pre-MLP norm
    ``pre_feedforward_layernorm``, the norm after the MLP ``post_feedforward_layernorm``."""

    def __init__(self, c: Any, layer_idx: int, spec: DecoderLayerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        size, eps, offset = c.hidden_size, spec.eps, spec.norm_offset
        self.self_attn = LlamaAttention(c, layer_idx, spec, dtype)
        self.mlp = LlamaMLP(c, spec, dtype)
        self.input_layernorm = RMSNorm(size, eps, dtype, offset)
        if spec.post_attention_norm:
            self.post_attention_layernorm = PlainRMSNorm(size, eps, dtype, offset)
            self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype, offset)
        else:
            self.post_attention_layernorm = RMSNorm(size, eps, dtype, offset)
        if spec.post_mlp_norm:
            self.post_feedforward_layernorm = PlainRMSNorm(size, eps, dtype, offset)

    @property
    def pre_mlp_norm(self) -> RMSNorm:
        if self.spec.post_attention_norm:
            return self.pre_feedforward_layernorm
        return self.post_attention_layernorm

    @property
    def post_attention_norm(self) -> PlainRMSNorm | None:
        return self.post_attention_layernorm if self.spec.post_attention_norm else None

    @property
    def post_mlp_norm(self) -> PlainRMSNorm | None:
        return self.post_feedforward_layernorm if self.spec.post_mlp_norm else None

    def attention_stage(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        reduce: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, reduce)
        if self.spec.post_attention_norm:  # on the reduced sums: stages() refuses reduce=False
            hidden = self.post_attention_layernorm(hidden)
        return hidden, residual

    def mlp_stage(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        reduce: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.pre_mlp_norm(hidden, residual)
        hidden = self.mlp(hidden, reduce)
        if self.spec.post_mlp_norm:
            hidden = self.post_feedforward_layernorm(hidden)
        return hidden, residual

    def stages(self) -> tuple[Stage, Stage] | None:
        """The two halves forward runs, each ending in a row-parallel all-reduce that the
        caller may take over (worker/overlap.py); None where a norm follows that reduction."""
        if self.spec.post_attention_norm or self.spec.post_mlp_norm:
            return None
        return self.attention_stage, self.mlp_stage

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.attention_stage(positions, hidden, residual)
        return self.mlp_stage(positions, hidden, residual)


LayerSpecFn = Callable[[Any, int], DecoderLayerSpec]


class LlamaModel(nn.Module):
    def __init__(
        self,
        c: Any,
        dtype: torch.dtype,
        layer_spec: LayerSpecFn = llama_layer_spec,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype)
        specs = [layer_spec(c, i) for i in range(c.num_hidden_layers)]
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(c, i, spec, dtype) for i, spec in enumerate(specs)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, specs[0].norm_offset)
        # Gemma: embeddings times sqrt(hidden_size), rounded to the dtype first (as HF does)
        self.embed_scale = None
        if embed_scale is not None:
            self.embed_scale = float(torch.tensor(embed_scale, dtype=dtype, device="cpu"))

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [T, hidden], when given, replace the embedding of input_ids."""
        hidden = self.get_input_embeddings(input_ids) if hidden_states is None else hidden_states
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (parameter name, shard id) for projections fused here
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    layer_spec: LayerSpecFn = staticmethod(llama_layer_spec)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, dtype, self.layer_spec, self.embed_scale_for(hf_config))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logit_softcap = getattr(hf_config, "final_logit_softcapping", None)

    def embed_scale_for(self, hf_config: Any) -> float | None:
        """A factor on the embeddings' output (Gemma: sqrt(hidden_size)); None: none."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (logits only where needed: compute_logits).

        hidden_states (a partition tier's input from the tier before) replace the embedding.
        """
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, the values of the model dtype's logits widened (sampling's
        input); Gemma's soft cap is applied in the model dtype first, as HF does."""
        if not self.logit_softcap:
            return self.lm_head(hidden, out_dtype=torch.float32)
        logits = self.lm_head(hidden)  # Gemma: cap * tanh(logits / cap)
        return (torch.tanh(logits / self.logit_softcap) * self.logit_softcap).float()

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

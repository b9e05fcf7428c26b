"""The Llama family: Llama, Mistral (sliding window) and Qwen2 (qkv bias, tied embeddings).

The model works on a flat batch of tokens ([num_tokens] ids and positions); which sequence
each token belongs to lives in the attention metadata, not in the tensors' shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.communicator import SINGLE, Communicator, OverlapCommunicator
from pagedllm.distributed.overlap import MicroBatch, Stage, interleave
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.loader import MissingLayer


def _window_left(hf_config: Any, layer_idx: int) -> int:
    """Keys a layer's queries may look back (flash-attn's window_size[0]); -1 = unlimited."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return -1
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window - 1 if layer_types[layer_idx] == "sliding_attention" else -1
    if getattr(hf_config, "use_sliding_window", True) is False:
        return -1
    return window - 1


class LlamaAttention(nn.Module):
    def __init__(self, c: Any, layer_idx: int, dtype: torch.dtype, comm: Communicator) -> None:
        super().__init__()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        num_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        bias = getattr(c, "attention_bias", False) or c.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size,
            head_dim,
            c.num_attention_heads,
            num_kv,
            bias=bias,
            dtype=dtype,
            comm=comm,
        )
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * head_dim,
            c.hidden_size,
            bias=getattr(c, "o_proj_bias", False),
            dtype=dtype,
            comm=comm,
        )
        theta, scaling = rope_parameters(c)
        self.rotary_emb = RotaryEmbedding(
            head_dim, c.max_position_embeddings, theta, scaling, dtype
        )
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, _window_left(c, layer_idx))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, reduce: bool = True
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q, k = self.rotary_emb(
            positions,
            q.view(num_tokens, -1, self.attn.head_dim),
            k.view(num_tokens, -1, self.attn.head_dim),
        )
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v), reduce)


class LlamaMLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype, comm: Communicator) -> None:
        super().__init__()
        size = c.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size, [size, size], dtype=dtype, comm=comm
        )
        self.down_proj = RowParallelLinear(size, c.hidden_size, dtype=dtype, comm=comm)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)), reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: Any, layer_idx: int, dtype: torch.dtype, comm: Communicator) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(c, layer_idx, dtype, comm)
        self.mlp = LlamaMLP(c, dtype, comm)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    # The two halves as overlap stages: each returns partial sums still to be all-reduced.
    def attention_stage(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, hidden, reduce=False), residual

    def mlp_stage(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, reduce=False), residual


class LlamaModel(nn.Module):
    """Decoder layers [start, end) of layer_range (default: all); the embedding only on the
    tier that starts at 0, the final norm only on the tier that ends at the last layer."""

    def __init__(
        self,
        c: Any,
        dtype: torch.dtype,
        comm: Communicator = SINGLE,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = layer_range or (0, c.num_hidden_layers)
        first, last = self.start_layer == 0, self.end_layer == c.num_hidden_layers
        self.embed_tokens = (
            VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype, comm)
            if first
            else MissingLayer()
        )
        # Absent layers keep their index, so parameter names match the checkpoint's.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(c, i, dtype, comm)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype) if last else MissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [T, hidden] from the previous tier replace the embedding."""
        hidden = self.embed_tokens(input_ids) if hidden_states is None else hidden_states
        residual = None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if isinstance(self.norm, MissingLayer):
            # Hand the residual stream on; the next tier starts with residual None, which
            # its first input_layernorm treats exactly as this hidden + residual.
            return hidden if residual is None else hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_overlapped(
        self, batches: list[MicroBatch], comm: OverlapCommunicator
    ) -> torch.Tensor:
        """The same forward over micro-batches whose all-reduces overlap each other's compute."""
        stages: list[Stage] = []
        for layer in self.layers[self.start_layer : self.end_layer]:
            stages += [layer.attention_stage, layer.mlp_stage]
        sizes = [len(b.input_ids) for b in batches]
        embedded = self.embed_tokens(torch.cat([b.input_ids for b in batches]))  # one reduce
        hidden = list(embedded.split(sizes))
        outs = interleave(stages, batches, hidden, comm)
        return torch.cat([self.norm(h, r)[0] for h, r in outs])


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (parameter name, shard id) for projections fused here
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        comm: Communicator = SINGLE,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, dtype, comm, layer_range)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if isinstance(self.model.norm, MissingLayer):
            self.lm_head: nn.Module = MissingLayer()
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype, comm)
        if self.tie_word_embeddings and isinstance(self.model.embed_tokens, MissingLayer):
            # A last tier without the embedding loads the tied matrix as its own head.
            self.tie_word_embeddings = False
            self.weight_aliases = {"model.embed_tokens.weight": "lm_head.weight"}
        elif self.tie_word_embeddings and not isinstance(self.lm_head, MissingLayer):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (logits only where needed: compute_logits).

        A partition tier takes the previous tier's hidden_states instead of input_ids and,
        unless it is the last, returns the residual stream for the next tier.
        """
        return self.model(input_ids, positions, hidden_states)

    def forward_overlapped(
        self, batches: list[MicroBatch], comm: OverlapCommunicator
    ) -> torch.Tensor:
        """forward() with communication overlap (tensor parallel; see distributed.overlap)."""
        return self.model.forward_overlapped(batches, comm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [
            layer.self_attn.attn
            for layer in self.model.layers
            if not isinstance(layer, MissingLayer)
        ]

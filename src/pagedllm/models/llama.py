"""The Llama family: Llama, Mistral (sliding window) and Qwen2 (qkv bias, tied embeddings).

The model works on a flat batch of tokens ([num_tokens] ids and positions); which sequence
each token belongs to lives in the attention metadata, not in the tensors' shapes. It is a
plain model: its layers take their tensor-parallel group from distributed.parallel_state,
the overlapped micro-batch schedule lives in worker.overlap, and a partition tier's layer
range is cut out by the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from pagedllm.attention.metadata import ForwardContext
from pagedllm.config import head_dim, num_kv_heads
from pagedllm.layers import cpu_fused
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters

# The cached operands of the fused CPU decoder layers: (dtype, watch list, operands or None).
FusedCache = tuple[
    torch.dtype, list[tuple[dict[str, Any], str, Any]], "cpu_fused.DecoderOperands | None"
]

# (positions, hidden, residual, reduce) -> (hidden, residual); reduce=False leaves the
# row-parallel partial sums for the caller to all-reduce (communication overlap).
Stage = Callable[..., tuple[torch.Tensor, torch.Tensor]]


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
    def __init__(self, c: Any, layer_idx: int, dtype: torch.dtype) -> None:
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
        theta, scaling = rope_parameters(c)
        self.rotary_emb = RotaryEmbedding(dim, c.max_position_embeddings, theta, scaling, dtype)
        self.attn = Attention(heads, kv_heads, dim, dim**-0.5, _window_left(c, layer_idx))

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
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        size = c.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [size, size], dtype=dtype)
        self.down_proj = RowParallelLinear(size, c.hidden_size, dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)), reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(c, layer_idx, dtype)
        self.mlp = LlamaMLP(c, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self._fused_operands: FusedCache | None = None  # this layer alone, see forward

    def attention_stage(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        reduce: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, hidden, reduce), residual

    def mlp_stage(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        reduce: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, reduce), residual

    def fused_watch(self) -> list[tuple[dict[str, Any], str]]:
        """(namespace, name) of each attribute whose replacement changes this layer's fused
        operands: the KV cache and backend bound to its attention, its modules, each linear's
        weight and int8 kernel (quantization swaps those in place). Read from the namespaces
        directly, the check costs microseconds a step."""
        attn, mlp = self.self_attn, self.mlp
        watch = [
            (attn.attn.__dict__, "key_cache"), (attn.attn.__dict__, "backend"),
            (attn._modules, "qkv_proj"), (attn._modules, "o_proj"),
            (mlp._modules, "gate_up_proj"), (mlp._modules, "down_proj"),
            (self._modules, "self_attn"), (self._modules, "mlp"),
        ]  # fmt: skip
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            watch += [(lin._parameters, "weight"), (lin.__dict__, "quant_kernel")]
        return watch

    def add_fused_operands(self, dtype: torch.dtype, operands: cpu_fused.DecoderOperands) -> bool:
        """Append this layer to the fused CPU decoder's operands; False if it cannot run it
        (then nothing is appended)."""
        attn, mlp = self.self_attn, self.mlp
        norms = (
            self.input_layernorm.fused_operands(dtype),
            self.post_attention_layernorm.fused_operands(dtype),
        )
        rotary = attn.rotary_emb.fused_operands(dtype)
        attention = attn.attn.fused_operands(dtype)
        linears = [
            lin.fused_operands()
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if None in norms or rotary is None or attention is None or None in linears:
            return False
        operands.add_layer(norms, rotary, attention, linears)  # type: ignore[arg-type]
        return True

    def stages(self) -> tuple[Stage, Stage]:
        """The two halves forward runs, each ending in a row-parallel all-reduce."""
        return self.attention_stage, self.mlp_stage

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on its own (LlamaModel runs all layers in one call where it can)."""
        operands = _cpu_fused_operands(self, [self], hidden)
        if operands is not None:
            return cpu_fused.decoder_layers(
                hidden, positions, operands, ForwardContext.get(), residual
            )
        hidden, residual = self.attention_stage(positions, hidden, residual)
        return self.mlp_stage(positions, hidden, residual)


class LlamaModel(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(c, i, dtype) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self._fused_operands: FusedCache | None = None  # see _cpu_fused_operands

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [T, hidden], when given, replace the embedding of input_ids."""
        hidden = self.embed_tokens(input_ids) if hidden_states is None else hidden_states
        # All layers in one C++ call, unless a layer has forward hooks (the partition
        # profiler times each layer): then each layer runs on its own (fused where it can).
        operands = None if _hooked(self.layers) else _cpu_fused_operands(self, self.layers, hidden)
        if operands is not None:
            hidden, residual = cpu_fused.decoder_layers(
                hidden, positions, operands, ForwardContext.get()
            )
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def _hooked(layers: nn.ModuleList) -> bool:
    """Whether forward hooks watch the layers (so they must be called one by one)."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return True
    return any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)


def _cpu_fused_operands(
    owner: nn.Module, layers: list[nn.Module] | nn.ModuleList, hidden: torch.Tensor
) -> cpu_fused.DecoderOperands | None:
    """The operands of the fused CPU decoder layers for ``layers`` when each can run there (a
    CPU model on one rank, float or C++ int8 linears, the C++ attention kernel); None if one
    cannot. Another tier's pass-through layers are skipped.

    Collecting them costs about a tenth of a batch-1 step, so they are kept on ``owner``
    until a layer's KV cache or one of its modules is replaced (cache allocation,
    quantization): a watch list of (namespace, name, object) is checked instead."""
    if hidden.dim() != 2 or not cpu_fused.decoder_usable(hidden):
        return None
    cached = owner._fused_operands
    if (
        cached is not None
        and cached[0] is hidden.dtype
        and all(space.get(name) is obj for space, name, obj in cached[1])
    ):
        return cached[2]
    operands: cpu_fused.DecoderOperands | None = cpu_fused.DecoderOperands()
    watch = []
    if isinstance(layers, nn.ModuleList):  # the model's own list: entries may be replaced
        watch += [(owner._modules, "layers", layers)]
        watch += [(layers._modules, name, layer) for name, layer in layers.named_children()]
    for layer in layers:
        if getattr(layer, "passes_through", False):  # another tier's layer
            continue
        if not isinstance(layer, LlamaDecoderLayer):
            operands = None
            break
        watch += [(space, name, space.get(name)) for space, name in layer.fused_watch()]
        if operands is not None and not layer.add_fused_operands(hidden.dtype, operands):
            operands = None
    if operands is not None and not operands.tensors:
        operands = None  # a tier without decoder layers
    owner._fused_operands = (hidden.dtype, watch, operands)
    return operands


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (parameter name, shard id) for projections fused here
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, dtype)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

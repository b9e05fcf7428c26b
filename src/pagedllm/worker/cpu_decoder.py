"""The fused CPU decoder: every decoder layer of a step in one C++ call.

At decode a layer's own work is a few small products; the Python around them (a dozen module
calls, views and checks per layer) then costs as much as the products. The runner builds a
:class:`CpuFusedDecoder` from the loaded (and quantized) model once its KV cache is bound, and
rebuilds it when weights, kernels or caches change (ModelRunner.rebuild_fast_path). It reads
each layer's declaration (layers/decoder_spec.py) and modules, and csrc/fused_ops.cpp runs the
same kernels in the same order as the modules' ``forward_cpu``, so results are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers import cpu_fused
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.norm import RMSNorm
from pagedllm.models.loader import PassThroughLayer

_ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


@dataclass
class DecoderOperands:
    """The flat operand lists of the C++ op, layer after layer (the layout is
    csrc/fused_ops.cpp's: per layer 26 tensors, 12 ints and 2 floats)."""

    tensors: list[torch.Tensor | None] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)


@dataclass
class DecodeSteps:
    """The batch of `count` decode steps of one token a sequence, as the ops take each step:
    row i of positions, seq_lens and each KV cache group's slot mapping is step i's; the
    query starts and block tables stay (every slot the steps write is in the tables already).
    Lists by KV cache group: one entry for a model without groups."""

    count: int
    positions: torch.Tensor  # [count, sequences] int64
    seq_lens: torch.Tensor  # [count, sequences] int32: keys after each step's token
    cu_seqlens_q: torch.Tensor  # [sequences + 1] int32: 0, 1, 2, ...
    slot_mappings: list[torch.Tensor]  # per group: [count, sequences] int64
    block_tables: list[torch.Tensor]  # per group: [sequences, blocks] int32

    @classmethod
    def ahead(
        cls,
        first: torch.Tensor,
        block_tables: list[torch.Tensor],
        cu_seqlens_q: torch.Tensor,
        block_size: int,
        count: int,
    ) -> DecodeSteps:
        """From the first step's positions (one a sequence) on, over each group's tables."""
        positions = first[None, :] + torch.arange(count)[:, None]
        offsets, index = positions % block_size, (positions // block_size).T
        slots = [
            (table.long().gather(1, index).T * block_size + offsets).contiguous()
            for table in block_tables
        ]
        seq_lens = (positions + 1).to(torch.int32)
        return cls(count, positions, seq_lens, cu_seqlens_q.contiguous(), slots, block_tables)

    def batch(self, i: int, group: int) -> tuple[torch.Tensor, ...]:
        """Step i's batch for KV cache group `group`, as CpuFusedDecoder._batch gives a
        step's: slot mapping, query starts, key counts, block tables."""
        return (
            self.slot_mappings[group][i], self.cu_seqlens_q, self.seq_lens[i],
            self.block_tables[group],
        )  # fmt: skip


def _norm_weight(norm: RMSNorm | None, spec_eps: float, dtype: torch.dtype) -> torch.Tensor | None:
    """A norm's weight; None for an absent norm. Raises _Unfusable for one the op cannot run."""
    if norm is None:
        return None
    if norm.impl != "cpu" or norm.weight.dtype != dtype or norm.eps != spec_eps:
        raise _Unfusable(f"a norm that is not the C++ one in {dtype} (eps {spec_eps})")
    return norm.weight


class _Unfusable(Exception):
    """A layer the fused decoder cannot run (the runner then runs the modules)."""


def _linear(lin: nn.Module) -> tuple[list[torch.Tensor | None], int]:
    operands = lin.fused_operands() if isinstance(lin, LinearBase) else None
    if operands is None:
        raise _Unfusable(f"{type(lin).__name__}: no fused form of its product")
    return operands


def _attention(attn: Attention) -> tuple[list[torch.Tensor], list[int]]:
    if attn.backend is None:
        raise _Unfusable("attention without a KV cache")
    # attention runs in the cache's dtype (kv_cache_dtype), q converted to it as Attention does
    cache_dtype = attn.key_cache.dtype
    if cache_dtype not in cpu_fused.CACHE_DTYPES:
        raise _Unfusable(f"a KV cache in {cache_dtype}")
    tiles = attn.backend.cpu_kernel_tiles(cache_dtype, attn.num_heads, attn.key_cache)
    if tiles is None:
        raise _Unfusable(f"attention backend {attn.backend.name!r} is not the C++ kernel")
    ints = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window_left, *tiles]
    return [attn.key_cache, attn.value_cache], ints


def _add_layer(operands: DecoderOperands, layer: nn.Module, dtype: torch.dtype) -> None:
    """Append one layer as its declaration says; raises _Unfusable (nothing appended)."""
    spec = getattr(layer, "spec", None)
    if spec is None:
        raise _Unfusable(f"{type(layer).__name__} declares no DecoderLayerSpec")
    attn_mod, mlp = layer.self_attn, layer.mlp
    attn = attn_mod.attn
    if attn.scale != spec.scale or attn.window_left != spec.window_left:
        raise _Unfusable("attention differs from the layer's declaration")
    rotary = attn_mod.rotary_emb
    if rotary.impl != "cpu" or rotary.cos.dtype != dtype or mlp.act_fn.impl != "cpu":
        raise _Unfusable("rotary or activation is not the C++ op")
    eps = spec.eps
    norms = [
        _norm_weight(layer.input_layernorm, eps, dtype),
        _norm_weight(layer.post_attention_norm, eps, dtype),
        _norm_weight(layer.pre_mlp_norm, eps, dtype),
        _norm_weight(layer.post_mlp_norm, eps, dtype),
        _norm_weight(attn_mod.q_norm, eps, dtype),
        _norm_weight(attn_mod.k_norm, eps, dtype),
    ]
    if spec.qk_norm != (norms[4] is not None):
        raise _Unfusable("q / k norms differ from the layer's declaration")
    caches, attn_ints = _attention(attn)
    linears = [_linear(m) for m in (attn_mod.qkv_proj, attn_mod.o_proj, mlp.gate_up_proj,
                                    mlp.down_proj)]  # fmt: skip
    operands.tensors += [*norms, rotary.cos, rotary.sin, *caches]
    for tensors, _ in linears:
        operands.tensors += tensors
    operands.ints += attn_ints + [levels for _, levels in linears]
    operands.ints += [_ACTIVATION_CODES[spec.activation], int(spec.norm_offset)]
    operands.floats += [eps, spec.scale]


@dataclass
class Segment:
    """A run of consecutive layers of one KV cache group: its operands (which tests read) and
    the same operands in C++ once (a step passes this handle, not hundreds of tensors)."""

    operands: DecoderOperands
    kv_group: int
    plan: torch.ScriptObject = field(init=False)

    def __post_init__(self) -> None:
        ops = self.operands
        self.plan = torch.classes.pagedllm_fused.DecoderPlan(ops.tensors, ops.ints, ops.floats)


@dataclass
class ModelEnds:
    """A whole model's ends around its decoder layers, for the same C++ call: the token
    embedding (where the op can look tokens up as the module does), the final norm and the
    LM head (csrc/fused_ops.cpp's EndsPlan)."""

    norm: torch.Tensor
    head: list[torch.Tensor | None]  # weight, rowsum, scale, bias, as a layer's linear
    embedding: list[torch.Tensor | None]  # the table's a, b, c (csrc's embedding kinds)
    ints: list[int]  # head level, norm kind, vocabulary size, embedding kind (-1: none), bits
    floats: list[float]  # the norm's eps, the embeddings' scale (0: none)
    plan: torch.ScriptObject = field(init=False)

    def __post_init__(self) -> None:
        tensors = [self.norm, *self.head, *self.embedding]
        self.plan = torch.classes.pagedllm_fused.EndsPlan(tensors, self.ints, self.floats)

    @property
    def embeds(self) -> bool:
        """Whether the op looks the tokens up itself."""
        return self.ints[3] >= 0

    @classmethod
    def build(cls, model: nn.Module, dtype: torch.dtype) -> ModelEnds | None:
        """The ends of a causal LM whose logits are its LM head's product over the final
        norm's output, widened to float32 (LlamaForCausalLM.compute_logits without a soft
        cap); None where another form computes them or the C++ op cannot run its head."""
        from pagedllm.models.llama import LlamaForCausalLM, LlamaModel

        if type(model).compute_logits is not LlamaForCausalLM.compute_logits:
            return None
        if getattr(model, "logit_softcap", None):
            return None
        head = getattr(model, "lm_head", None)
        fused = head.fused_operands() if hasattr(head, "fused_operands") else None
        if fused is None:
            return None
        inner = model.model
        try:
            norm = _norm_weight(inner.norm, inner.norm.eps, dtype)
        except _Unfusable:
            return None
        operands, level = fused
        kind, embedding, bits = -1, [None, None, None], 0
        table = inner.embed_tokens
        lookup = getattr(table, "fused_lookup", None)
        # the op looks tokens up where the model adds nothing to the module's lookup (but
        # Gemma's scale, which the plan carries) and the rows come out in the model's dtype
        looks_up = (
            lookup is not None
            and type(inner).get_input_embeddings is LlamaModel.get_input_embeddings
            and getattr(table, "dequant_dtype", dtype) == dtype
        )
        if looks_up and (found := lookup()) is not None:
            kind, embedding, bits = found
        ints = [level, int(inner.norm.offset), head.vocab_size, kind, bits]
        floats = [inner.norm.eps, inner.embed_scale or 0.0]
        return cls(norm, operands, embedding, ints, floats)


class CpuFusedDecoder:
    """The decoder layers of one model (one partition tier's), packed for the C++ op.

    One C++ call per run of consecutive layers of the same KV cache group (each group has
    its own block tables and slot mapping): a single call for single-group models. Given
    the model's ends (:meth:`with_ends`), the last call also runs the final norm and the LM
    head, and a single call looks the tokens up too (:meth:`logits`)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments  # in layer order
        self.ends: ModelEnds | None = None

    def with_ends(self, ends: ModelEnds | None) -> CpuFusedDecoder:
        """This decoder with the model's ends (None: without)."""
        self.ends = ends
        return self

    @property
    def operands(self) -> DecoderOperands:
        """The first segment's operands (every layer's, for a single-group model)."""
        return self.segments[0].operands

    @classmethod
    def build(cls, layers: nn.ModuleList, dtype: torch.dtype) -> CpuFusedDecoder | None:
        """From the layers as they are now; None (with the reason logged by the caller) when
        a layer cannot run here. Another tier's pass-through layers are skipped."""
        if dtype not in cpu_fused.DTYPES or not cpu_fused.load():
            return None
        runs: list[tuple[DecoderOperands, int]] = []  # (operands, kv_group)
        for layer in layers:
            if isinstance(layer, PassThroughLayer):
                continue
            group = layer.self_attn.attn.kv_group
            if not runs or runs[-1][1] != group:
                runs.append((DecoderOperands(), group))
            try:
                _add_layer(runs[-1][0], layer, dtype)
            except _Unfusable:
                return None
        return cls([Segment(ops, group) for ops, group in runs]) if runs else None

    @staticmethod
    def why_not(layers: nn.ModuleList, dtype: torch.dtype) -> str:
        """Why :meth:`build` returned None (for the log)."""
        if dtype not in cpu_fused.DTYPES:
            return f"no C++ kernels for {dtype}"
        if not cpu_fused.load():
            return "the C++ fused ops are not built"
        for layer in layers:
            if isinstance(layer, PassThroughLayer):
                continue
            try:
                _add_layer(DecoderOperands(), layer, dtype)
            except _Unfusable as e:
                return str(e)
        return "no decoder layers in this tier"

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer, as the layers' own forward would return
        them (the final norm is the caller's); residual None: the first layer starts it."""
        positions = positions.contiguous()
        for segment in self.segments:
            hidden, residual = torch.ops.pagedllm_fused.decoder_layers(
                hidden, residual, positions, segment.plan, *self._batch(segment, metadata)
            )
        assert residual is not None
        return hidden, residual

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor | None,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm's output, the float32 logits of its `rows`, every row where None)
        for the tokens: what the embedding (`embed`, the model's), the layers, the final norm
        and the model's compute_logits give, the ends in the last segment's call (and the
        embedding in the first's, where that is the same call and the op can look up)."""
        batches = [self._batch(segment, metadata) for segment in self.segments]
        return self._logits(input_ids, positions.contiguous(), batches, rows, embed)

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        steps: DecodeSteps,
        embed: Callable[[torch.Tensor], torch.Tensor],
        argmax: Callable[[torch.Tensor], torch.Tensor],
        stops: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy decode steps of one token a sequence, each step's picks the next one's
        input, with no Python between them but the calls: [steps run, sequences] token ids.
        Each step is :meth:`logits` then `argmax` over the rows, as a step of its own
        computes them. The decoder must hold the model's ends. stops ([sequences, k], padded
        with -1): the steps end after the first that picks one of its row's tokens there, so
        that the batch loses that sequence where one step a schedule would."""
        tokens = []
        ids = input_ids
        for i in range(steps.count):
            batches = [steps.batch(i, segment.kv_group) for segment in self.segments]
            _, logits = self._logits(ids, steps.positions[i], batches, None, embed)
            ids = argmax(logits)
            tokens.append(ids)
            if stops is not None and bool((ids[:, None] == stops).any()):
                break
        return torch.stack(tokens)

    def _logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batches: list[tuple[torch.Tensor, ...]],
        rows: torch.Tensor | None,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits() over each segment's batch as the ops take it (_batch)."""
        assert self.ends is not None
        hidden, residual = input_ids, None
        if len(self.segments) > 1 or not self.ends.embeds:
            hidden = embed(input_ids)
        for segment, batch in zip(self.segments[:-1], batches):
            hidden, residual = torch.ops.pagedllm_fused.decoder_layers(
                hidden, residual, positions, segment.plan, *batch
            )
        return torch.ops.pagedllm_fused.decoder_logits(
            hidden, residual, positions, self.segments[-1].plan, self.ends.plan, *batches[-1], rows
        )

    @staticmethod
    def _batch(segment: Segment, metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The step's batch as the ops take it for segment's KV cache group: slot mapping,
        query starts, key counts, block tables."""
        md = metadata.for_group(segment.kv_group)
        return (
            md.slot_mapping,
            md.batch.cu_seqlens_q.contiguous(),
            md.batch.seq_lens_k.contiguous(),
            md.block_table,
        )


def run_fused(
    model: nn.Module,
    decoder: CpuFusedDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    hidden_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's forward with its decoder layers in one call: embedding (or the previous
    tier's hidden_states), the fused layers, the final norm. [num_tokens, hidden]."""
    inner = model.model
    hidden = inner.get_input_embeddings(input_ids) if hidden_states is None else hidden_states
    hidden, residual = decoder(hidden, positions, metadata)
    return inner.norm(hidden, residual)[0]


def run_fused_logits(
    model: nn.Module,
    decoder: CpuFusedDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """run_fused and the model's compute_logits on `rows` of its output (every row where
    None), with the model's ends in the decoder's C++ calls (the decoder holds them):
    (hidden [num_tokens, hidden], float32 logits)."""
    return decoder.logits(input_ids, positions, metadata, rows, model.model.get_input_embeddings)

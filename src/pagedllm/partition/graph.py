"""The per-layer cost graph of a model: what each node weighs and computes per token.

The graph is read off the model itself (its modules' parameters and buffers, so an int8
model weighs what it holds), either the loaded model or one built on the meta device
from its config (no memory, no weights). Nodes run in order: the embedding, decoder
layers 0 .. L-1, and the head (final norm + LM head). A cut k between two tiers sends the
hidden state after layer k-1; its size is the same at every cut (hidden_size per token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.config import head_dim, kv_bytes_per_token
from pagedllm.dtypes import torch_dtype
from pagedllm.partition.profiles import LayerTimings

OPS_PER_MODULE = 3  # kernels a leaf module launches, roughly: the floor of a layer's time


@dataclass(frozen=True)
class GraphNode:
    name: str  # "embed" | "layer.<i>" | "head"
    weight_bytes: int  # parameters and persistent buffers held (resident memory)
    streamed_bytes: int  # of which read every step (matmul weights; not embedding rows)
    flops_per_token: float  # context-independent FLOPs per token (2 x matmul weights)
    flops_per_sample: float  # FLOPs per sampled token (the LM head runs only there)
    attn_flops_per_pair: float  # FLOPs per (query token, key token) pair
    kv_bytes_per_token: int  # K and V this node caches per token of context
    read_bytes_per_token: int  # other bytes read per token (embedding rows)
    num_ops: int  # kernels per call, for the per-op dispatch floor


@dataclass(frozen=True)
class ModelGraph:
    name: str
    nodes: tuple[GraphNode, ...]  # embed, layer.0 .. layer.L-1, head
    hidden_size: int
    dtype: str  # compute dtype of the weights
    measured: dict[str, LayerTimings] = field(default_factory=dict)  # device name -> timings

    @property
    def num_layers(self) -> int:
        return len(self.nodes) - 2

    def tier_nodes(self, start: int, end: int) -> list[int]:
        """Node indices of a tier running decoder layers [start, end), with the embedding
        when start is 0 and the head when end is the last layer."""
        first = [0] if start == 0 else []
        last = [len(self.nodes) - 1] if end == self.num_layers else []
        return first + list(range(start + 1, end + 1)) + last

    def to_dict(self) -> dict[str, Any]:
        """The graph and its measured timings as JSON-ready data (see from_dict)."""
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            "measured": [dataclasses.asdict(t) for t in self.measured.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelGraph:
        graph = cls(
            data["name"],
            tuple(GraphNode(**n) for n in data["nodes"]),
            data["hidden_size"],
            data["dtype"],
        )
        for timings in data.get("measured", ()):
            graph = graph.with_timings(LayerTimings.from_dict(timings))
        return graph

    def with_timings(self, timings: LayerTimings) -> ModelGraph:
        """A copy whose estimates on timings.device use these measured times."""
        if len(timings.decode_s) != len(self.nodes):
            raise ValueError(
                f"timings have {len(timings.decode_s)} nodes, the graph {len(self.nodes)}."
            )
        return dataclasses.replace(self, measured={**self.measured, timings.device: timings})


def _state_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of the state dict, elements of its 2-D tensors: the matmul weights). A loaded
    CPU model's weights in panels (layers/panel_gemm.py, buffers outside the state dict, an
    empty ``weight`` in it) count as the 2-D weights they hold."""
    total = matmul = 0
    panels = [b for name, b in module.named_buffers() if name.endswith("weight_panels")]
    for tensor in [*module.state_dict().values(), *panels]:
        total += tensor.numel() * tensor.element_size()
        if tensor.dim() == 2 or tensor.dim() == 3 and any(tensor is p for p in panels):
            matmul += tensor.numel()
    return total, matmul


def _num_ops(module: nn.Module) -> int:
    leaves = sum(1 for m in module.modules() if not list(m.children()))
    return max(1, leaves * OPS_PER_MODULE)


def build_model_graph(model: nn.Module, hf_config: Any, dtype: str, name: str) -> ModelGraph:
    """The cost graph of a Llama-family model (pagedllm's module layout), loaded or on meta."""
    c = hf_config
    elem = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
    inner = model.model
    embed_bytes, _ = _state_bytes(inner.embed_tokens)
    nodes = [
        GraphNode("embed", embed_bytes, 0, 0.0, 0.0, 0.0, 0, c.hidden_size * elem, 1),
    ]
    for i, layer in enumerate(inner.layers):
        weight, matmul = _state_bytes(layer)
        nodes.append(
            GraphNode(
                name=f"layer.{i}",
                weight_bytes=weight,
                streamed_bytes=weight,
                flops_per_token=2.0 * matmul,
                flops_per_sample=0.0,
                attn_flops_per_pair=4.0 * c.num_attention_heads * head_dim(c),  # QK^T and PV
                kv_bytes_per_token=kv_bytes_per_token(c, elem, layers=1),
                read_bytes_per_token=0,
                num_ops=_num_ops(layer),
            )
        )
    norm_bytes, _ = _state_bytes(inner.norm)
    # Tied embeddings still cost the head tier its own copy once the model is split.
    head_bytes, head_matmul = _state_bytes(model.lm_head)
    nodes.append(
        GraphNode(
            name="head",
            weight_bytes=norm_bytes + head_bytes,
            streamed_bytes=norm_bytes + head_matmul * elem,
            flops_per_token=4.0 * c.hidden_size,
            flops_per_sample=2.0 * head_matmul,
            attn_flops_per_pair=0.0,
            kv_bytes_per_token=0,
            read_bytes_per_token=0,
            num_ops=_num_ops(inner.norm) + _num_ops(model.lm_head),
        )
    )
    return ModelGraph(name, tuple(nodes), c.hidden_size, dtype)


def graph_from_config(hf_config: Any, dtype: str, name: str) -> ModelGraph:
    """The cost graph without loading weights: the model is built on the meta device."""
    from pagedllm.config import architecture_of
    from pagedllm.models.registry import get_model_class

    with torch.device("meta"):
        model = get_model_class(architecture_of(hf_config))(hf_config, torch_dtype(dtype))
    return build_model_graph(model, hf_config, dtype, name)


def graph_for_model(model_path: str, dtype: str = "auto") -> ModelGraph:
    """The cost graph of a local Hugging Face model folder, in the dtype it would run in."""
    from pagedllm.config import EngineArgs

    config = EngineArgs(model=model_path, dtype=dtype, device="cpu").create_engine_config()
    return graph_from_config(config.model.hf_config, config.model.dtype, model_path)

"""The runner's side of multi-LoRA: wraps the targeted linear layers once, keeps up to
max_loras adapters in slots (least recently used evicted) and, each step, maps the step's
tokens to the slots of their sequences' adapters."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.lora.adapter import read_adapter_config, read_adapter_weights
from pagedllm.lora.layers import LoRABatch, LoRALinear, SubProjection
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# fused layer -> the checkpoint projections it holds, in output order
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
SINGLE = ("o_proj", "down_proj")
SUPPORTED = frozenset(n for names in FUSED.values() for n in names) | frozenset(SINGLE)


def _sub_projections(leaf: str, layer: LinearBase) -> list[SubProjection]:
    """Where each projection's rows lie in this rank's output and in the adapter's full B."""
    rank = layer.comm.rank
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        kv_rank = rank // layer.kv_replicas
        sizes, sources = [q, kv, kv], [rank * q, kv_rank * kv, kv_rank * kv]
    elif isinstance(layer, MergedColumnParallelLinear):
        sizes = [s // layer.comm.world_size for s in layer.output_sizes]
        sources = [rank * s for s in sizes]
    elif isinstance(layer, ColumnParallelLinear):
        return [SubProjection(leaf, 0, layer.out_features, rank * layer.out_features)]
    else:
        return [SubProjection(leaf, 0, layer.out_features)]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    names = FUSED[leaf]
    return [SubProjection(*args) for args in zip(names, offsets, sizes, sources)]


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = {}  # module path -> wrapped layer
        self._wrap(model)
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.free_slots = list(range(max_loras))
        self.adapters_per_step: list[int] = []  # distinct adapters in each step (not base)
        self.num_loads = 0

    def _wrap(self, model: nn.Module) -> None:
        for path, module in list(model.named_modules()):
            parent_path, _, leaf = path.rpartition(".")
            if (leaf not in FUSED and leaf not in SINGLE) or not isinstance(module, LinearBase):
                continue
            parent = model.get_submodule(parent_path)
            in_offset = 0
            if isinstance(module, RowParallelLinear):
                in_offset = module.comm.rank * module.in_features
            subs = _sub_projections(leaf, module)
            wrapped = LoRALinear(module, subs, self.batch, self.max_loras, self.max_rank, in_offset)
            setattr(parent, leaf, wrapped)
            self.layers[path] = wrapped
        if not self.layers:
            raise ValueError("enable_lora: the model has no projection layers LoRA can target.")

    # ---- adapters ------------------------------------------------------------------------
    def _slot_for(self, req: LoRARequest, pinned: set[int]) -> int:
        slot = self.slots.get(req.lora_int_id)
        if slot is not None:
            self.slots.move_to_end(req.lora_int_id)
            return slot
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next((i for i in self.slots if i not in pinned), None)
            if victim is None:
                raise ValueError(f"a step needs more than max_loras ({self.max_loras}) adapters.")
            slot = self.slots.pop(victim)
        try:
            self._load(req, slot)
        except Exception:
            self.free_slots.append(slot)
            raise
        self.slots[req.lora_int_id] = slot
        return slot

    def _load(self, req: LoRARequest, slot: int) -> None:
        cfg = read_adapter_config(req.lora_path, self.max_rank)
        per_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, ab in read_adapter_weights(req.lora_path).items():
            parent, _, leaf = module.rpartition(".")
            if leaf not in SUPPORTED:
                raise ValueError(f"LoRA {req.lora_name}: target {leaf!r} is not supported.")
            fused = next((f for f, names in FUSED.items() if leaf in names), leaf)
            per_layer.setdefault(f"{parent}.{fused}", {})[leaf] = ab
        unknown = set(per_layer) - set(self.layers)
        if unknown:
            raise ValueError(f"LoRA {req.lora_name}: no layer {sorted(unknown)[0]!r} here.")
        for path, layer in self.layers.items():
            layer.set_slot(slot, per_layer.get(path, {}), cfg.scaling)
        self.num_loads += 1
        logger.info("LoRA %s (id %d) loaded into slot %d", req.lora_name, req.lora_int_id, slot)

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded): its slot is reused by the next one loaded."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, requests: list[Any], query_lens: list[int], device: torch.device) -> None:
        """requests[i] (a LoRARequest or None) runs query_lens[i] consecutive tokens."""
        ids = {r.lora_int_id for r in requests if r is not None}
        slot_of: dict[int, int] = {}
        for req in requests:
            if req is not None and req.lora_int_id not in slot_of:
                slot_of[req.lora_int_id] = self._slot_for(req, ids)
        per_token = np.repeat(
            np.array([-1 if r is None else slot_of[r.lora_int_id] for r in requests]),
            query_lens,
        )
        self.batch.groups = [
            (slot, torch.from_numpy(np.flatnonzero(per_token == slot)).to(device))
            for slot in sorted(set(slot_of.values()))
        ]
        self.adapters_per_step.append(len(slot_of))
        del self.adapters_per_step[:-1024]  # a bounded history

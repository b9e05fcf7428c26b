"""A linear layer with a batched LoRA product beside its base weights.

The base product runs over every row unchanged; each adapter present in the step then adds
``x[rows] A^T B^T`` (scaling folded into B at load) to its own rows only. A fused layer
(qkv_proj, gate_up_proj) holds one rank block of A per projection it fuses and a B whose
rows for that projection read only that block, so one product per adapter serves all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """This step's rows per adapter slot: [(slot, row indices)], base rows in none."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class SubProjection:
    """One checkpoint projection inside a (possibly fused) layer: its output rows."""

    name: str  # the name adapters use, e.g. "q_proj"
    out_offset: int  # its first row in this rank's output
    out_size: int  # its rows on this rank
    src_offset: int = 0  # this rank's first row of the adapter's full B (column parallel)


class LoRALinear(nn.Module):
    """Wraps a linear layer; every other attribute reads through to it. The product joins the
    base layer's matmul (its per-rank partial product under tensor parallelism), so a
    row-parallel layer's all-reduce sums the LoRA partials too: with A split by input
    columns as the weight is, sum_ranks x_r A_r^T B^T = x A^T B^T."""

    def __init__(
        self,
        base: nn.Module,
        subs: list[SubProjection],
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        in_offset: int = 0,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_offset = in_offset  # this rank's first input column (row parallel)
        self.subs = subs
        self.batch = batch
        self.max_rank = max_rank
        dtype, device = base.weight.dtype, base.weight.device
        width = len(subs) * max_rank
        shape_a = (max_loras, width, base.in_features)
        self.lora_a = torch.zeros(shape_a, dtype=dtype, device=device)
        self.lora_b = torch.zeros((max_loras, base.out_features, width), dtype=dtype, device=device)
        self.slot_used = [False] * max_loras  # slots whose adapter targets this layer
        self._base_matmul = base.matmul
        base.matmul = self._matmul  # an instance attribute: the class's matmul stays as is

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever the base layer holds
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 scaling: float) -> None:  # fmt: skip
        """Write one adapter's A/B (sub name -> (A [r, in], B [out, r])) into slot."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_used[slot] = False
        for i, sub in enumerate(self.subs):
            if sub.name not in weights:
                continue
            a, b = weights[sub.name]
            r = a.shape[0]
            inputs, outputs = self.base.in_features, sub.out_size
            if a.shape[1] < self.in_offset + inputs or b.shape[0] < sub.src_offset + outputs:
                raise ValueError(
                    f"LoRA {sub.name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the "
                    f"layer (its shard: {inputs} inputs, {outputs} outputs)."
                )
            if r > self.max_rank:
                raise ValueError(f"LoRA {sub.name}: rank {r} is above max_lora_rank.")
            a = a.narrow(1, self.in_offset, inputs)
            b = b.narrow(0, sub.src_offset, outputs)
            cols = slice(i * self.max_rank, i * self.max_rank + r)
            self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
            rows = slice(sub.out_offset, sub.out_offset + sub.out_size)
            self.lora_b[slot, rows, cols] = (b.float() * scaling).to(self.lora_b.dtype)
            self.slot_used[slot] = True

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        return self.base(x, *args, **kwargs)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._base_matmul(x, bias)
        for slot, rows in self.batch.groups:
            if not self.slot_used[slot]:
                continue
            xs = x.index_select(0, rows)
            delta = (xs @ self.lora_a[slot].T) @ self.lora_b[slot].T
            y.index_add_(0, rows, delta.to(y.dtype))
        return y

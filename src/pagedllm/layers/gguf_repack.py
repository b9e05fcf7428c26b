"""GGUF quantized blocks -> the weight-only kernel's layout, without dequantizing.

A GGUF tensor of a block type stores each row of the weight as consecutive blocks of 32
features (``GGUFReader``'s ``tensor.data``: uint8 [rows, bytes per row]):

* Q8_0 (34 bytes): fp16 d, 32 int8 q;             w = d * q
* Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;   w = d * (q - 8)
* Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes;      w = d * q + m

with nibble j of a Q4 block in the low half of byte j and nibble j + 16 in the high half,
the order layers/weight_only.py keeps. So the codes are copied byte for byte and only the
per-block fp16 constants are widened to fp32 (exactly): group 32, scale = d, and for int4
offset = m (Q4_1) or -8 d (Q4_0, q - 8 written as q plus an offset).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.weight_only import BLOCK, PackedWeight

# GGML type ids (ggml.h's enum ggml_type, also gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q8_0 = 2, 3, 8
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


def supported(tensor_type: int) -> bool:
    return int(tensor_type) in _BLOCK_BYTES


def repack(data: np.ndarray, tensor_type: int) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes per row], as GGUFReader gives them, or
    any array of that many bytes per row) -> a PackedWeight of the same rows x features."""
    kind = int(tensor_type)
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"GGUF tensor type {kind} is not one of Q4_0, Q4_1, Q8_0")
    size = _BLOCK_BYTES[kind]
    raw = np.require(data, dtype=np.uint8, requirements=["C", "W"])  # copies a read-only map
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{NAMES[kind]} rows must be whole {size}-byte blocks, got {raw.shape}")
    rows, blocks = raw.shape[0], raw.shape[1] // size
    b = torch.from_numpy(raw).view(rows, blocks, size)
    d = b[..., 0:2].contiguous().view(torch.float16).view(rows, blocks).float()
    if kind == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).view(rows, blocks * BLOCK)
        return PackedWeight(8, q, d.contiguous(), None)
    if kind == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).view(rows, blocks).float()
        codes = b[..., 4:]
    else:
        m = -8.0 * d
        codes = b[..., 2:]
    q = codes.contiguous().view(rows, blocks * (BLOCK // 2))
    return PackedWeight(4, q, d.contiguous(), m.contiguous())


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights by rows (q, k, v into a merged qkv; gate and up into gate_up)."""
    first = parts[0]
    if any(p.bits != first.bits or p.shape[1] != first.shape[1] or p.group != first.group
           for p in parts):  # fmt: skip
        raise ValueError("parts must share bits, features and group size to be stacked")
    offsets = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    return PackedWeight(
        first.bits,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scale for p in parts]),
        offsets,
    )


def select_rows(weight: PackedWeight, index: torch.Tensor) -> PackedWeight:
    """Rows reordered (e.g. undoing the q / k row permutation of llama.cpp's conversion)."""
    return PackedWeight(
        weight.bits,
        weight.qweight[index].contiguous(),
        weight.scale[index].contiguous(),
        None if weight.offset is None else weight.offset[index].contiguous(),
    )

"""GGUF quantized blocks -> the weight-only kernel's layout, without dequantizing.

A GGUF tensor of a block type stores each row of the weight as consecutive blocks of 32
features (``GGUFReader``'s ``tensor.data``: uint8 [rows, bytes per row]):

* Q8_0 (34 bytes): fp16 d, 32 int8 q;             w = d * q
* Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;   w = d * (q - 8)
* Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes;      w = d * q + m
* Q4_K (144 bytes per 256 features): fp16 d and dmin, 12 bytes of 6-bit scales sc and mins mn
  for eight 32-feature sub-blocks, 128 bytes of nibbles (32 bytes per two sub-blocks: the
  first in the low halves, the second in the high ones); w = d * sc * q - dmin * mn

with nibble j of a Q4 block in the low half of byte j and nibble j + 16 in the high half,
the order layers/weight_only.py keeps. So the codes are copied byte for byte and the
per-block fp16 constants kept in fp16: group 32, scale = d, and for int4 offset = m (Q4_1) or
-8 d (Q4_0, q - 8 written as q plus an offset; exact in fp16, a power of two). The panel and
row kernels stream them as they are. Q4_K's sub-blocks are 32 features too: their codes are
regrouped into that nibble order and its two-level constants multiplied out, in fp32 (d * sc
and -dmin * mn are exact there, an fp16 times a 6-bit integer, not in fp16).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.weight_only import BLOCK, PackedWeight, pack_int4

# GGML type ids (ggml.h's enum ggml_type, also gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K"}


def supported(tensor_type: int) -> bool:
    return int(tensor_type) in _BLOCK_BYTES


def repack(data: np.ndarray, tensor_type: int) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes per row], as GGUFReader gives them, or
    any array of that many bytes per row) -> a PackedWeight of the same rows x features."""
    kind = int(tensor_type)
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"GGUF tensor type {kind} is not one of Q4_0, Q4_1, Q8_0, Q4_K")
    size = _BLOCK_BYTES[kind]
    raw = np.require(data, dtype=np.uint8, requirements=["C", "W"])  # copies a read-only map
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{NAMES[kind]} rows must be whole {size}-byte blocks, got {raw.shape}")
    rows, blocks = raw.shape[0], raw.shape[1] // size
    if kind == Q4_K:
        return _repack_q4_k(raw.reshape(rows * blocks, size), rows)
    b = torch.from_numpy(raw).view(rows, blocks, size)
    d = b[..., 0:2].contiguous().view(torch.float16).view(rows, blocks)
    if kind == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).view(rows, blocks * BLOCK)
        return PackedWeight(8, q, d.contiguous(), None)
    if kind == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).view(rows, blocks)
        codes = b[..., 4:]
    else:
        m = -8.0 * d
        codes = b[..., 2:]
    q = codes.contiguous().view(rows, blocks * (BLOCK // 2))
    return PackedWeight(4, q, d.contiguous(), m.contiguous())


def _repack_q4_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Q4_K super-blocks [rows * n, 144] -> int4 with group 32 (module docstring)."""
    from gguf.quants import Q4_K as GGUF_Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [rows * n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = GGUF_Q4_K.get_scale_min(blocks[:, 4:16])  # [rows * n, 8] each, 6-bit
    scale = (d * sc.astype(np.float32)).reshape(rows, -1)
    offset = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # two sub-blocks per 32 bytes: low, high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, -1)  # feature order
    return PackedWeight(
        4,
        pack_int4(torch.from_numpy(np.ascontiguousarray(codes))),
        torch.from_numpy(np.ascontiguousarray(scale)),
        torch.from_numpy(np.ascontiguousarray(offset)),
    )


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

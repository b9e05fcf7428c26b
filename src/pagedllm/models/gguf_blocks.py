"""A GGUF file's quantized tensors kept in their blocks: Q4_0 / Q4_1 / Q4_K / Q8_0 weights of the
linear layers, the LM head and the token embedding become packed weight-only weights
(layers/gguf_repack.py copies their codes byte for byte), so the model holds about the bytes
of the file and its products run on the weight-only kernels. Tensors of other types (norms,
Q6_K and the other K-quants) are dequantized to the model's dtype and loaded as usual.

The parts of a projection fused here (q, k, v into qkv_proj; gate and up into gate_up_proj)
are stacked by rows once all of them are read.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers import gguf_repack, weight_only
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization import install_packed
from pagedllm.layers.weight_only import PackedWeight
from pagedllm.models.gguf_loader import GGUFTensor

logger = logging.getLogger(__name__)

_SHARD_ORDER = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
_EMBEDDING = "model.embed_tokens.weight"


def _packable(module: nn.Module) -> bool:
    if isinstance(module, LinearBase):
        return module.comm.world_size == 1
    return type(module) in (VocabParallelEmbedding, ParallelLMHead)


def install_gguf_blocks(
    model: nn.Module,
    tensors: Iterable[GGUFTensor],
    dtype: torch.dtype,
    resolve_name: Callable[[nn.Module, str], tuple[str, int | str | None]],
) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """Install every packable tensor of the file on its module (resolve_name: the loader's
    checkpoint name -> parameter name and shard). Returns the other tensors (Hugging Face
    name, dequantized to dtype) for the usual loader, and the parameters installed here."""
    rest: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, dict[int, PackedWeight]] = {}
    expected: dict[str, int] = {}
    for param, _ in getattr(model, "packed_modules", {}).values():
        expected[param] = expected.get(param, 0) + 1  # parts per fused projection
    installed: set[str] = set()
    kinds: Counter[str] = Counter()
    for tensor in tensors:
        name, shard = resolve_name(model, tensor.name)
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if leaf == "weight" else None
        if module is None or not gguf_repack.supported(tensor.ggml_type) or not _packable(module):
            rest.append((tensor.name, tensor.dequantize(dtype)))
            continue
        packed = gguf_repack.repack(tensor.blocks(), tensor.ggml_type)
        kinds[gguf_repack.NAMES[int(tensor.ggml_type)]] += 1
        if shard is not None:
            group = parts.setdefault(module_name, {})
            group[_SHARD_ORDER[shard]] = packed
            if len(group) < expected[module_name.rpartition(".")[2]]:
                continue
            packed = gguf_repack.concat_rows([group[i] for i in sorted(group)])
            del parts[module_name]
        packed = weight_only.cpu_layout(packed)  # once, so that a tied head shares it
        install_packed(module, packed, int8_x=True)  # llama.cpp's numerics (an LM head: none)
        installed.add(name)
        if name == _EMBEDDING and getattr(model, "tie_word_embeddings", False):
            install_packed(model.lm_head, packed)  # the tied head shares the codes
    if parts:
        raise ValueError(f"GGUF file lacks parts of {', '.join(sorted(parts))}")
    logger.info(
        "GGUF tensors kept in their blocks: %s",
        ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "none",
    )
    return rest, installed

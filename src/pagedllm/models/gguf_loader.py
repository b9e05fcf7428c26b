"""A GGUF file's tensors under Hugging Face names, in their blocks or dequantized.

:class:`GGUFTensor` is one tensor of the file (pagedllm.gguf_metadata opens it) under its
Hugging Face name, with the converter's own changes undone: llama.cpp reorders the rows of
Llama's q/k projections for its rotary layout, and stores Gemma's norms as ``1 + w``. Its
:meth:`GGUFTensor.blocks` are the raw quantized rows in Hugging Face row order (for kernels
that keep the format), :meth:`GGUFTensor.dequantize` the values in a torch dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.gguf_metadata import ARCHITECTURES, GGUFFile

if TYPE_CHECKING:
    import gguf
    import torch


# ------------------------------------------------------------------ tensor names


def _hf_module_names(arch: str, num_layers: int) -> list[str]:
    """Every module name (without .weight/.bias) a model of this architecture may hold."""
    per_layer = [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    if arch in ("qwen3", "gemma3"):
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    if arch == "gemma3":
        per_layer += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    return names + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in per_layer]


def gguf_to_hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """llama.cpp tensor name (without .weight/.bias) -> Hugging Face module name, from the
    gguf package's own name table (TensorNameMap) for this architecture."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    mapping = {}
    for hf in _hf_module_names(arch, num_layers):
        name = table.get_name(hf)
        if name is not None:
            mapping[name] = hf
    return mapping


_QK_ROWS = re.compile(r"\.self_attn\.(q|k)_proj\.(weight|bias)$")
_IGNORED = ("rope_freqs.weight",)  # folded into the config's rope_scaling


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file under its Hugging Face name, in its stored block format."""

    name: str  # Hugging Face parameter name (model.layers.0.self_attn.q_proj.weight)
    ggml_type: gguf.GGMLQuantizationType  # F32, F16, BF16, Q8_0, Q4_1, Q4_K ...
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a linear weight
    raw: np.ndarray  # uint8 [rows, bytes per row] blocks (F32/F16: the values), memory-mapped
    row_order: np.ndarray | None  # Hugging Face row i is stored row row_order[i]; None: same
    offset: float = 0.0  # subtracted after dequantizing (Gemma stores norms as 1 + w)

    def blocks(self) -> np.ndarray:
        """The stored quantized rows in Hugging Face row order: [rows, bytes per row]."""
        raw = self.raw.reshape(self.shape[0], -1) if self.raw.ndim > 1 else self.raw
        return raw if self.row_order is None else raw[self.row_order]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as a torch tensor of ``shape`` in ``dtype``."""
        import torch
        from gguf.quants import dequantize

        values = dequantize(self.blocks(), self.ggml_type).reshape(self.shape)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:  # F32 tensors come straight from the memory map
            values = values.copy()
        tensor = torch.from_numpy(values)
        if self.offset:
            tensor = tensor - self.offset
        return tensor.to(dtype)


def _unpermute_order(rows: int, heads: int) -> np.ndarray:
    """The stored row of each Hugging Face row of a q/k projection. llama.cpp's converter
    interleaves each head's two rotary halves (rows [h, 2, d/2] stored as [h, d/2, 2]) so
    its rotary pairs adjacent dimensions; reading them in this order restores the halves."""
    half = rows // heads // 2
    stored = np.arange(rows).reshape(heads, half, 2)  # stored row at [head, i, part]
    return stored.transpose(0, 2, 1).reshape(rows)  # HF row [head, part, i]


def iterate_gguf_tensors(file: GGUFFile, config: Any) -> Iterator[GGUFTensor]:
    """Every model tensor of the file under its Hugging Face name, in file order."""
    names = gguf_to_hf_names(file.arch, config.num_hidden_layers)
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for t in file.reader.tensors:
        if t.name in _IGNORED:
            continue
        base, _, suffix = t.name.rpartition(".")
        if base not in names:
            raise ValueError(
                f"GGUF tensor {t.name!r} of {file.path.name!r} has no counterpart in a "
                f"{ARCHITECTURES[file.arch][1]}."
            )
        name = f"{names[base]}.{suffix}"
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        order = None
        qk = _QK_ROWS.search(name)
        if file.arch == "llama" and qk:
            order = _unpermute_order(shape[0], heads[qk.group(1)])
        offset = 1.0 if file.arch == "gemma3" and base.endswith("norm") else 0.0
        yield GGUFTensor(name, t.tensor_type, shape, t.data, order, offset)


def iterate_gguf_weights(
    file: GGUFFile, config: Any, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor dequantized to dtype) for every model tensor of the file."""
    for tensor in iterate_gguf_tensors(file, config):
        yield tensor.name, tensor.dequantize(dtype)

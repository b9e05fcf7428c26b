"""A GGUF file as a model: its config, its tensors under Hugging Face names, dequantized.

GGUF (llama.cpp's format) holds one model in one file: metadata (architecture numbers, the
tokenizer's vocabulary, the chat template) and tensors in llama.cpp's names and block
formats. This module reads it with the ``gguf`` package, llama.cpp's own reader:

- :func:`gguf_config_dict` turns the metadata into the fields a config.json of the same model
  has (the model type's names: ``hidden_size``, ``num_key_value_heads``, ``rope_theta`` ...),
  which :mod:`pagedllm.hf_config` then completes like any config.json;
- :class:`GGUFTensor` is one tensor in its stored blocks under its Hugging Face name, with the
  conversion's own changes undone (llama.cpp reorders the rows of Llama's q/k projections
  for its rotary layout; Gemma's norms are stored as ``1 + w``); its :meth:`GGUFTensor.blocks`
  are the raw quantized rows (for kernels that keep the format), :meth:`GGUFTensor.dequantize`
  the values in a torch dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf
    import torch

# general.architecture -> (config.json model_type, architecture class pagedllm runs)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# metadata key (after "<arch>.") -> config.json field, for every architecture above
_COMMON_FIELDS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
}
# llama.cpp runs Gemma 3 with every sixth layer global and the local layers' rotary base fixed
# at 10000; neither is written in the file.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Llama 3.x rotary scaling parameters that Meta's releases use; llama.cpp stores the scaling
# only as the per-frequency factors it implies (the rope_freqs tensor).
_LLAMA3_ROPE_CANDIDATES = (
    {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)


def is_gguf(path: str | Path) -> bool:
    """Whether path is a GGUF file (by its magic bytes, not its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """An opened GGUF file: metadata values and tensors (memory-mapped, read lazily)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot read GGUF file {str(self.path)!r}: {e}") from e
        self.arch = str(self.value("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"GGUF file {self.path.name!r} holds architecture {self.arch!r}, which pagedllm "
                f"does not load; supported GGUF architectures: {', '.join(ARCHITECTURES)}."
            )

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python data (str, int, float, bool or a list of them)."""
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.arch}.{key}", default)

    @cached_property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


@lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The opened file, shared by the config, tokenizer and weight readers of one process
    (parsing a file's metadata takes seconds: its vocabulary is tens of thousands of strings)."""
    path = Path(path).resolve()
    return _open_cached(path, path.stat().st_mtime_ns)


def gguf_config_dict(file: GGUFFile) -> dict[str, Any]:
    """The model's config.json fields, from the file's metadata."""
    model_type, architecture = ARCHITECTURES[file.arch]
    raw: dict[str, Any] = {"model_type": model_type, "architectures": [architecture]}
    for key, name in _COMMON_FIELDS.items():
        value = file.arch_value(key)
        if value is not None:
            raw[name] = value
    for key, name in _TOKEN_IDS.items():
        value = file.value(key)
        if value is not None:
            raw[name] = int(value)
    if "vocab_size" not in raw:
        raw["vocab_size"] = len(file.value("tokenizer.ggml.tokens") or ())
    if file.arch == "llama" and "head_dim" not in raw:
        raw["head_dim"] = file.arch_value("rope.dimension_count")
    if file.arch == "qwen2" and raw.get("head_dim") == raw["hidden_size"] // raw.get(
        "num_attention_heads", 1
    ):
        del raw["head_dim"]  # Qwen2's config.json has none: hidden_size / heads
    raw["tie_word_embeddings"] = "output.weight" not in file.tensor_names
    _rope_scaling(file, raw)
    if file.arch == "gemma3":
        _gemma3_fields(file, raw)
    return {k: v for k, v in raw.items() if v is not None}


def _rope_scaling(file: GGUFFile, raw: dict[str, Any]) -> None:
    kind = file.arch_value("rope.scaling.type")
    factor = file.arch_value("rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        raw["rope_scaling"] = {"rope_type": kind, "factor": float(factor)}
        original = file.arch_value("rope.scaling.original_context_length")
        if original:
            raw["rope_scaling"]["original_max_position_embeddings"] = int(original)
    if "rope_freqs.weight" in file.tensor_names:
        raw["rope_scaling"] = _llama3_rope_scaling(file, raw)


def _llama3_rope_scaling(file: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.x scaling from the per-frequency factors the file stores: the known parameter
    sets are tried and the one that reproduces every factor is kept."""
    from gguf.quants import dequantize

    tensor = next(t for t in file.reader.tensors if t.name == "rope_freqs.weight")
    stored = dequantize(tensor.data, tensor.tensor_type).reshape(-1).astype(np.float64)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    theta = float(raw.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(stored.max())
    for candidate in _LLAMA3_ROPE_CANDIDATES:
        params = {"rope_type": "llama3", "factor": factor, **candidate}
        if np.allclose(_llama3_factors(inv_freq, params), stored, rtol=1e-3):
            return params
    raise ValueError(
        f"GGUF file {file.path.name!r} stores rotary frequency factors (rope_freqs) that match "
        "no Llama 3 rope_scaling pagedllm knows; load the model's Hugging Face folder instead."
    )


def _llama3_factors(inv_freq: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """What each frequency is divided by under Llama 3 scaling (llama.cpp's rope_freqs)."""
    original = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = np.where(wavelen > original / low, factor, 1.0)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return np.where(middle, 1.0 / ((1 - smooth) / factor + smooth), scaled)


def _gemma3_fields(file: GGUFFile, raw: dict[str, Any]) -> None:
    layers = raw["num_hidden_layers"]
    raw["sliding_window"] = file.arch_value("attention.sliding_window")
    raw["layer_types"] = [
        "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(layers)
    ]
    # config.json's form: a rotary setting per layer type
    full = {"rope_type": "default", "rope_theta": float(raw.pop("rope_theta", 1e6))}
    full |= raw.pop("rope_scaling", None) or {}
    local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}
    raw["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    # llama.cpp scales queries by 1/sqrt(head_dim), Gemma 3's query_pre_attn_scalar
    raw["query_pre_attn_scalar"] = raw.get("head_dim")
    raw["tie_word_embeddings"] = True  # Gemma's output head is always its embedding


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

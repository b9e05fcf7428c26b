"""A GGUF file's metadata: the architecture, the config it implies, the tokenizer's fields.

GGUF (llama.cpp's format) holds one model in one file: metadata (architecture numbers, the
tokenizer's vocabulary, the chat template) and tensors in llama.cpp's names and block
formats. This module reads it with the ``gguf`` package, llama.cpp's own reader:

:func:`gguf_config_dict` turns the metadata into the fields a config.json of the same model
has (the model type's names: ``hidden_size``, ``num_key_value_heads``, ``rope_theta`` ...),
which :mod:`pagedllm.hf_config` then completes like any config.json. This module imports no
torch (the engine config reads it); the tensors are read by pagedllm.models.gguf_loader.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

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
    raw["dtype"] = weights_dtype(file)
    _rope_scaling(file, raw)
    if file.arch == "gemma3":
        _gemma3_fields(file, raw)
    return {k: v for k, v in raw.items() if v is not None}


# A file's float weight types, as the dtype a config.json would declare for them.
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def weights_dtype(file: GGUFFile) -> str | None:
    """The dtype the file's matrices are stored in, where they are all one float type (a
    converter's f32 / f16 / bf16 file: its config.json's torch_dtype); None for a quantized
    file (its blocks hold no float dtype, and the engine's ``dtype="auto"`` then computes in
    float32, as transformers loads it). Vectors (norms, biases) are F32 in every file."""
    types = {t.tensor_type.name for t in file.reader.tensors if len(t.shape) > 1}
    if len(types) != 1:
        return None
    return _FLOAT_TYPES.get(types.pop())


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


def _gemma3_layer_types(file: GGUFFile, layers: int) -> list[str]:
    """Sliding or full attention per layer: the file's sliding_window_pattern (one flag per
    layer, true = sliding; or n: every n-th layer full) when it has one, else llama.cpp's
    Gemma 3 default of every sixth layer full."""
    pattern = file.arch_value("attention.sliding_window_pattern", _GEMMA3_GLOBAL_EVERY)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"GGUF file {file.path.name!r}: sliding_window_pattern has {len(pattern)} "
                f"entries for {layers} layers."
            )
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern)
        sliding = [every <= 0 or (i + 1) % every != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma3_fields(file: GGUFFile, raw: dict[str, Any]) -> None:
    raw["sliding_window"] = file.arch_value("attention.sliding_window")
    raw["layer_types"] = _gemma3_layer_types(file, raw["num_hidden_layers"])
    # config.json's form: a rotary setting per layer type
    full = {"rope_type": "default", "rope_theta": float(raw.pop("rope_theta", 1e6))}
    full |= raw.pop("rope_scaling", None) or {}
    local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}
    raw["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    # llama.cpp scales queries by 1/sqrt(head_dim), Gemma 3's query_pre_attn_scalar
    raw["query_pre_attn_scalar"] = raw.get("head_dim")
    raw["tie_word_embeddings"] = True  # Gemma's output head is always its embedding

"""Read a Hugging Face model folder's config.json without transformers.

The engine needs a few dozen numbers from config.json; importing transformers to read them
costs seconds. :func:`read_hf_config` returns an :class:`HFConfig` with the same field
values that ``transformers.AutoConfig`` gives for the architectures pagedllm runs (Llama,
Mistral, Qwen2): each model type's defaults, ``num_key_value_heads`` and ``head_dim``
filled in, ``rope_parameters`` (alias ``rope_scaling``) merged from the old and new field
names, Mistral's and Qwen2's sliding-window rules. Fields are read as attributes, like a
``PretrainedConfig``; ``dtype`` is a string ("bfloat16"), never a torch dtype, so this
module imports neither torch nor transformers. Other model types go through transformers
when it is installed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# Defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config for the fields that
# config.json files commonly leave out.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_key_value_heads": None,
    "rope_parameters": None,
}
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON
    | {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "pretraining_tp": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
    },
    "mistral": _COMMON
    | {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
        "head_dim": None,
    },
    "qwen2": _COMMON
    | {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}
_DEFAULT_ROPE_THETA = 10000.0


class HFConfig:
    """A model's config.json fields as attributes, with its model type's defaults applied."""

    model_type: str

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"HFConfig({self.to_dict()!r})"

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The old name of rope_parameters, as transformers keeps it."""
        return self.__dict__.get("rope_parameters")

    @property
    def torch_dtype(self) -> str | None:
        """The old name of dtype."""
        return self.__dict__.get("dtype")

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the fields."""
        return copy.deepcopy(self.__dict__)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters as transformers 5 builds it: rope_scaling/rope_parameters + theta."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", float(raw.get("rope_theta") or _DEFAULT_ROPE_THETA))
    return params


def from_dict(raw: dict[str, Any]) -> HFConfig:
    """An HFConfig from config.json's contents; ValueError for an unknown model_type."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_DEFAULTS:
        raise ValueError(
            f"model_type {model_type!r} is not one pagedllm reads itself "
            f"({', '.join(MODEL_DEFAULTS)})."
        )
    fields = copy.deepcopy(MODEL_DEFAULTS[model_type]) | copy.deepcopy(raw)
    for old in ("rope_scaling", "rope_theta"):
        fields.pop(old, None)
    fields["rope_parameters"] = _rope_parameters(raw)
    fields.pop("torch_dtype", None)
    fields["dtype"] = raw.get("dtype") or raw.get("torch_dtype")
    _require_ints(fields, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if model_type in ("llama", "mistral") and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type == "qwen2":
        _qwen2_sliding_window(fields)
    return HFConfig(**fields)


def _require_ints(fields: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.json field {name} must be a positive integer, got {value!r}.")


def _qwen2_sliding_window(fields: dict[str, Any]) -> None:
    """Qwen2: a window only with use_sliding_window, on layers from max_window_layers on."""
    if not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if fields["layer_types"] is None:
        window, first = fields["sliding_window"], fields["max_window_layers"]
        fields["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(fields["num_hidden_layers"])
        ]


def read_hf_config(folder: str | Path) -> Any:
    """The config of a local model folder: an HFConfig, or transformers' for other types."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    if raw.get("model_type") in MODEL_DEFAULTS:
        return from_dict(raw)
    return _transformers_config(Path(folder), raw.get("model_type"))


def _transformers_config(folder: Path, model_type: object) -> Any:
    """Other model types: transformers' AutoConfig when it is installed (an optional path)."""
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(
            f"model_type {model_type!r} of {folder / 'config.json'} needs transformers to read; "
            f"pagedllm reads {', '.join(MODEL_DEFAULTS)} itself."
        ) from e
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read {folder / 'config.json'}: {e}") from e


def config_from_dict(raw: dict[str, Any], origin: str) -> Any:
    """A config from config.json-style fields read elsewhere (a GGUF file's metadata): an
    HFConfig for the types read here, transformers' config class for the others."""
    if raw.get("model_type") in MODEL_DEFAULTS:
        return from_dict(raw)
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(
            f"model_type {raw.get('model_type')!r} of {origin} needs transformers to read; "
            f"pagedllm reads {', '.join(MODEL_DEFAULTS)} itself."
        ) from e
    fields = dict(raw)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def model_kind(model: str | Path) -> str:
    """ "folder" or "gguf" for a local model path; ValueError naming what to pass otherwise."""
    from pagedllm.gguf_metadata import is_gguf

    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {str(model)!r} has no config.json.")
        return "folder"
    if is_gguf(path):
        return "gguf"
    if path.is_file():
        raise ValueError(
            f"model {str(model)!r} is a file but not a GGUF file; pass a GGUF file, a local "
            "Hugging Face model folder (config.json + *.safetensors) or a hub id (org/name)."
        )
    raise ValueError(
        f"model {str(model)!r} is not a local folder or file; pass a Hugging Face model folder "
        "(config.json + *.safetensors), a GGUF file or a hub id (org/name)."
    )


def read_model_config(model: str | Path) -> Any:
    """The config of a local model: a folder's config.json or a GGUF file's metadata."""
    if model_kind(model) == "gguf":
        return read_gguf_config(model)
    return read_hf_config(model)


def read_gguf_config(path: str | Path) -> Any:
    """The config of a GGUF file, built from its metadata as from config.json fields."""
    from pagedllm.gguf_metadata import gguf_config_dict, open_gguf

    file = open_gguf(path)
    return config_from_dict(gguf_config_dict(file), origin=file.path.name)

"""Default sampling from a model folder's generation_config.json, read as vLLM reads it.

A model may ship the sampling it reads best with (temperature, top_p, ...). As in vLLM
(``--generation-config auto``), these values become the defaults of every request: a
request's own value wins, a field neither sets keeps SamplingParams' default. Only the
fields vLLM takes over are read; ``max_new_tokens`` becomes ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# --generation-config values that mean "SamplingParams' own defaults"
BUILTIN = ("pagedllm", "vllm")


def generation_config_folder(setting: str, model: str) -> str | None:
    """The folder whose generation_config.json gives defaults: "auto" = the model's own."""
    if setting == "auto":
        return model
    if setting in BUILTIN:
        return None
    if not Path(setting).is_dir():
        raise ValueError(
            f"generation_config must be 'auto', 'pagedllm' or a folder, got {setting!r}."
        )
    return setting


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) if name in ("top_k", "max_new_tokens") else True


def read_sampling_defaults(folder: str | None) -> dict[str, float | int]:
    """SamplingParams fields set by folder/generation_config.json ({} without one)."""
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    defaults: dict[str, float | int] = {}
    for name, field in SAMPLING_FIELDS.items():
        value = raw.get(name) if isinstance(raw, dict) else None
        if value is None:
            continue
        if not _valid(name, value):
            logger.warning("%s: ignoring %s=%r (not a number)", path, name, value)
            continue
        defaults[field] = value
    if defaults:
        logger.info("default sampling from %s: %s", path, defaults)
    return defaults


def with_defaults(defaults: dict[str, float | int], explicit: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: the explicit (not None) values over the defaults."""
    return dict(defaults) | {k: v for k, v in explicit.items() if v is not None}

"""SpeculativeConfig: the frozen form of EngineArgs.speculative_config (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.json_config import config_dict

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
_MAX_SPECULATIVE_TOKENS = 32  # one verify step carries 1 + k tokens per sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) | "draft_model" (a small model of the same vocab)
    num_speculative_tokens: int  # k: drafts verified per step and sequence
    prompt_lookup_max: int = 5  # ngram: longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram looked up
    model: str | None = None  # draft_model: local Hugging Face folder


def _positive_int(cfg: dict[str, Any], name: str, default: int | None) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise ValueError(f"speculative_config.{name} is required.")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")
    return value


def parse_speculative_config(raw: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """Validate the user's dict (or its JSON text); ValueError names the bad field."""
    raw = config_dict(raw, "speculative_config", _KEYS)
    if raw is None:
        return None
    method = raw.get("method") or ("draft_model" if raw.get("model") else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}.")
    k = _positive_int(raw, "num_speculative_tokens", None)
    if k > _MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config.num_speculative_tokens must be at most "
            f"{_MAX_SPECULATIVE_TOKENS}, got {k}."
        )
    if method == "ngram":
        return _ngram_config(raw, k)
    model = raw.get("model")
    if not isinstance(model, str) or not (Path(model) / "config.json").exists():
        raise ValueError(
            f"speculative_config.model must be a local Hugging Face model folder, got {model!r}."
        )
    return SpeculativeConfig("draft_model", k, model=model)


def _ngram_config(raw: dict[str, Any], k: int) -> SpeculativeConfig:
    if raw.get("model") is not None:
        raise ValueError("speculative_config.model is not used by method 'ngram'; drop it.")
    lookup_max = _positive_int(raw, "prompt_lookup_max", 5)
    lookup_min = _positive_int(raw, "prompt_lookup_min", min(2, lookup_max))
    if lookup_min > lookup_max:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({lookup_min}) must not exceed "
            f"prompt_lookup_max ({lookup_max})."
        )
    return SpeculativeConfig("ngram", k, lookup_max, lookup_min)

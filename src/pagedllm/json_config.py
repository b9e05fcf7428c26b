"""Config arguments given as a dict or as its JSON text (vLLM's speculative_config,
kv_events_config, partition_config): one parser, errors that name the argument."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def config_dict(
    raw: dict[str, Any] | str | None, name: str, known: Collection[str] | None = None
) -> dict[str, Any] | None:
    """raw as a dict (JSON text parsed), None for None; ValueError naming ``name`` when it is
    not JSON, not a dict, or (with ``known``) has fields outside ``known``."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a dict, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - set(known)) if known is not None else []
    if unknown:
        raise ValueError(f"{name} has unknown fields {unknown}; known: {sorted(known)}.")
    return raw

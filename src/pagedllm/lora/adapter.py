"""Reading an adapter in PEFT's format: its config (checked without torch, so the engine can
refuse a bad path at request time) and its A/B matrices keyed by the module they target."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]


def read_adapter_config(path: str, max_rank: int | None = None) -> AdapterConfig:
    """The adapter's rank, scaling and targets; ValueError naming what is wrong."""
    folder = Path(path)
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise ValueError(f"lora_path {path!r} has no {CONFIG_FILE}.")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora_path {path!r} has no {WEIGHTS_FILE}.")
    try:
        raw: dict[str, Any] = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_path {path!r}: {CONFIG_FILE} is not JSON ({e}).") from e
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path {path!r}: peft_type {raw.get('peft_type')!r} is not LORA.")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path {path!r}: r must be a positive integer, got {rank!r}.")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"lora_path {path!r}: r ({rank}) is above max_lora_rank ({max_rank}).")
    if raw.get("modules_to_save"):
        raise ValueError(f"lora_path {path!r}: modules_to_save is not supported.")
    alpha = float(raw.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    return AdapterConfig(rank, scaling, tuple(targets))


def read_adapter_weights(path: str) -> dict[str, tuple[Any, Any]]:
    """module path (as the model names it before fusing, e.g. ``model.layers.0.self_attn.
    q_proj``) -> (A [r, in], B [out, r]) as torch tensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    pairs: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        name = key.removeprefix("base_model.model.")
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[part] = value
                break
        else:
            raise ValueError(f"lora_path {path!r}: tensor {key!r} is not a LoRA A/B weight.")
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path {path!r}: {module} lacks its lora_A or lora_B.")
        out[module] = (ab["A"], ab["B"])
    return out

"""Architecture name (config.json "architectures") -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma3:Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}."
        )
    module_name, cls_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)

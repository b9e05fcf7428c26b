"""LoRARequest: which adapter a request runs with (vLLM's names and argument order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) at
    lora_path, named lora_name; lora_int_id (> 0) identifies it in the engine: requests with
    the same id share its weights and its prefix-cache entries."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

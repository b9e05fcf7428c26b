"""Multi-LoRA: PEFT adapters applied beside the base weights, many adapters in one batch."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

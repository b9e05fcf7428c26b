"""The one reader of the environment: every PAGEDLLM_* variable the engine honours."""

from __future__ import annotations

import os


def PAGEDLLM_ATTENTION_BACKEND() -> str | None:  # noqa: N802 - named after the variable
    """Force an attention backend by name ("torch", "cpu", "triton")."""
    return os.environ.get("PAGEDLLM_ATTENTION_BACKEND") or None


def PAGEDLLM_DEFAULT_MODEL() -> str | None:  # noqa: N802
    """Model folder used when none is given (defaults to the bundled demo model)."""
    return os.environ.get("PAGEDLLM_DEFAULT_MODEL") or None


def PAGEDLLM_LOG_LEVEL() -> str:  # noqa: N802
    return os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").upper()


def PAGEDLLM_CPU_KVCACHE_SPACE_GIB() -> float | None:  # noqa: N802
    """CPU KV-cache budget in GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE."""
    value = os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE")
    return float(value) if value else None

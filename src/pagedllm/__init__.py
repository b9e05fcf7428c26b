"""pagedllm: LLM inference and serving with a paged KV cache and a vLLM-compatible API.

The public names are imported lazily, so that the torch-free core (``pagedllm.core``'s
scheduler and block manager) can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "EngineArgs": "pagedllm.config",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "AsyncLLMEngine": "pagedllm.engine.async_engine",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.core.outputs",
    "CompletionOutput": "pagedllm.core.outputs",
    "Logprob": "pagedllm.core.outputs",
}

__all__ = [  # noqa: RUF022 - the order of _EXPORTS
    "LLM",
    "EngineArgs",
    "LLMEngine",
    "AsyncLLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]


__getattr__ = lazy_getattr(__name__, _EXPORTS)


if TYPE_CHECKING:
    from pagedllm.config import EngineArgs
    from pagedllm.core.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

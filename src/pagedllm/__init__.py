"""pagedllm: LLM inference and serving with a paged KV cache and a vLLM-compatible API."""

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

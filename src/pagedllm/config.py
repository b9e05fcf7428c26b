"""User-facing EngineArgs (vLLM's names) and the frozen configs each component receives."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import envs

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
_CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local Hugging Face folder
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    seed: int
    quantization: str | None

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"]
        return archs[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float  # share of device memory the engine may use (CUDA)
    kv_cache_memory_bytes: int | None  # explicit KV budget; the CPU default is 4 GiB


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    disable_comm_overlap: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" | "cuda"
    enforce_eager: bool
    attention_backend: str | None  # None: chosen for the device


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig


def default_model_path() -> str:
    """The bundled demo model: beside the installed package, or in a source checkout."""
    override = envs.PAGEDLLM_DEFAULT_MODEL()
    if override:
        return override
    here = Path(__file__).resolve()
    for root in (here.parent / "_models", here.parents[2] / "models"):
        candidate = root / "pagedllm-demo"
        if (candidate / "config.json").exists():
            return str(candidate)
    return str(here.parents[2] / "models" / "pagedllm-demo")


@dataclass
class EngineArgs:
    """Arguments of an LLMEngine, named and defaulted as vLLM's EngineArgs."""

    model: str = field(default_factory=default_model_path)
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    quantization: str | None = None
    device: str = "auto"
    attention_backend: str | None = None
    disable_comm_overlap: bool = False

    def create_engine_config(self) -> EngineConfig:
        self._verify()
        hf_config = load_hf_config(self.model)
        max_model_len = _max_model_len(hf_config, self.max_model_len)
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled."
            )
        if batched < self.max_num_seqs:
            batched = self.max_num_seqs  # every running sequence can decode in one step
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer or self.model,
                hf_config=hf_config,
                dtype=_resolve_dtype(self.dtype, hf_config, device),
                max_model_len=max_model_len,
                seed=self.seed,
                quantization=self.quantization,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel=ParallelConfig(self.tensor_parallel_size, self.disable_comm_overlap),
            device=DeviceConfig(
                device,
                self.enforce_eager,
                self.attention_backend or envs.PAGEDLLM_ATTENTION_BACKEND(),
            ),
        )

    def _verify(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face model folder.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        positive = ("block_size", "max_num_seqs", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def load_hf_config(model: str) -> Any:
    """Read config.json of a local model folder, with clear errors for the usual mistakes."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is not a folder; pass a local Hugging Face model folder "
            "(config.json + *.safetensors)."
        )
    if not (path / "config.json").exists():
        raise ValueError(f"model folder {model!r} has no config.json.")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path / 'config.json'}: {e}") from e


def _max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's "
            f"max_position_embeddings ({limit})."
        )
    return requested


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    aliases = {"half": "float16", "float": "float32"}
    if dtype != "auto":
        return aliases.get(dtype, dtype)
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(config_dtype).replace("torch.", "") if config_dtype is not None else "float32"
    if name == "float16" and device == "cpu":
        return "bfloat16"  # CPU float16 matmuls are slow; bf16 keeps the range
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def default_kv_cache_bytes() -> int:
    return _CPU_KV_CACHE_DEFAULT_BYTES

"""User-facing EngineArgs (vLLM's names) and the frozen configs each component receives."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.generation_config import generation_config_folder
from pagedllm.spec_config import SpeculativeConfig, parse_speculative_config

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
_CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"  # for a config.json that names no architecture
QUANT_METHOD = "pagedllm_int8"  # quantization_config.quant_method of a saved int8 checkpoint


@dataclass(frozen=True)
class QuantConfig:
    """int8 quantization (pagedllm.layers.quantization): what is quantized, and how."""

    quant_dtype: str = "int8"  # "int4": weight-only int4 with group scales
    observer_type: str = "minmax"  # activation scales: "minmax" (per token) | "moving_average"
    granularity: str = "per_channel"  # weight scales: per output row | "per_tensor"
    enable_activation: bool = True  # int8 x int8 matmuls; False: weight-only int8
    exclude_layers: tuple[str, ...] = ()  # module names or fnmatch patterns kept as they are
    prequantized: bool = False  # the checkpoint already holds int8 weights and their scales
    # Measured defaults (layers/quantization.py): None takes them.
    weight_only_layers: tuple[str, ...] | None = None  # int8 weights, full-precision inputs
    smoothquant_alpha: float | None = None  # activation-outlier migration; 0 disables it
    quantize_embeddings: bool = False  # the LM head and token embedding too (vLLM keeps them)
    group_size: int = 32  # int4: input features per scale and offset (a multiple of 32)

    def __post_init__(self) -> None:
        choices = {
            "quant_dtype": ("int8", "int4"),
            "observer_type": ("minmax", "moving_average"),
            "granularity": ("per_channel", "per_tensor"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local Hugging Face folder
    tokenizer: str
    hf_config: Any  # pagedllm.hf_config.HFConfig (transformers.PretrainedConfig for other types)
    dtype: str  # "float32" | "bfloat16" | "float16"
    seed: int
    layer_range: tuple[int, int] | None = None  # decoder layers of a partition tier; None: all
    quant_config: QuantConfig | None = None  # int8 quantization; None: full precision
    generation_config: str | None = None  # folder whose generation_config.json sets defaults

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return num_kv_heads(self.hf_config)

    @property
    def head_dim(self) -> int:
        return head_dim(self.hf_config)

    def kv_bytes_per_token(self, layers: int | None = None) -> int:
        """KV cache bytes one token takes over ``layers`` layers (default: all of them)."""
        return kv_bytes_per_token(self.hf_config, DTYPE_BYTES[self.dtype], layers)


# The shape facts of a Hugging Face config, written once; ModelConfig exposes them too.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def head_dim(hf_config: Any) -> int:
    c = hf_config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def num_kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def kv_bytes_per_token(hf_config: Any, elem_bytes: int, layers: int | None = None) -> int:
    """K and V of one token over ``layers`` layers (default: all) at elem_bytes per value."""
    num_layers = hf_config.num_hidden_layers if layers is None else layers
    return 2 * num_layers * num_kv_heads(hf_config) * head_dim(hf_config) * elem_bytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float  # share of device memory the engine may use (CUDA)
    # explicit KV budget (else PAGEDLLM_CPU_KVCACHE_SPACE on the CPU); the CPU default is 4 GiB
    kv_cache_memory_bytes: int | None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # the one copy: the scheduler stops sequences here, the engine checks
    enable_chunked_prefill: bool
    num_lookahead_slots: int = 0  # KV slots past a step's tokens (a draft model's decodes)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    disable_comm_overlap: bool = False
    nnodes: int = 1  # machines the tensor-parallel ranks are spread over
    node_rank: int = 0  # this machine's index; node 0 runs the engine (rank 0)
    master_addr: str | None = None  # rendezvous host (default: MASTER_ADDR, else 127.0.0.1)
    master_port: int = 0  # rendezvous port (0: MASTER_PORT, else a free one on one node)


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" | "cuda"
    enforce_eager: bool
    attention_backend: str | None  # None: chosen for the device


@dataclass(frozen=True)
class PartitionConfig:
    """This process's tier of an edge/cloud split. Plain settings only: the plan itself is
    read by pagedllm.partition (the split executor / cloud worker), not here."""

    plan: str  # path of the PartitionPlan JSON
    role: str  # "edge" (embedding, layers [0, cut), the engine) | "cloud" (the rest + head)
    address: str | None  # edge: the cloud worker's host:port; cloud: where to listen
    pipeline_depth: int = 1  # edge: engine steps (micro-batches) in flight across the tiers
    replan_interval: int = 64  # edge: steps between re-plans from measurements (0: never)
    fallback: str = "fail"  # edge, a lost link: "fail" the running requests | run them "local"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    partition: PartitionConfig | None = None  # None: the whole model in this process
    speculative: SpeculativeConfig | None = None  # None: one token per step and sequence


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
    # Tokens computed per step. A value below max_num_seqs also caps the batch at that many
    # sequences (each running sequence decodes one token a step), so prompts really chunk.
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
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 0
    partition: str | None = None  # PartitionPlan JSON: run one tier of an edge/cloud split
    partition_role: str = "edge"
    partition_address: str | None = None
    partition_pipeline_depth: int = 1
    partition_replan_interval: int = 64
    partition_fallback: str = "fail"
    quant_exclude: list[str] | None = None  # module names / patterns left unquantized
    quant_granularity: str = "per_channel"
    quant_observer: str = "minmax"
    quant_activation: bool = True
    quant_smoothing: bool = True  # int8: SmoothQuant folds from the calibration pass
    speculative_config: dict[str, Any] | str | None = None  # vLLM's dict (or its JSON text)
    generation_config: str = "auto"  # default sampling: "auto" (the model's), "pagedllm", a folder

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
        # Every running sequence must be able to decode in one step. A token budget below
        # max_num_seqs is kept as asked (it is what makes prompts chunk) and the batch is
        # capped at that many sequences instead: raising the budget would silently turn
        # chunked prefill off.
        max_num_seqs = min(self.max_num_seqs, batched)
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and device == "cpu":
            kv_bytes = envs.PAGEDLLM_CPU_KVCACHE_SPACE_BYTES()
        speculative = self._speculative_config(hf_config)
        lookahead = speculative.num_speculative_tokens if speculative and speculative.model else 0
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer or self.model,
                hf_config=hf_config,
                dtype=_resolve_dtype(self.dtype, hf_config, device),
                seed=self.seed,
                quant_config=self._quant_config(hf_config),
                generation_config=generation_config_folder(self.generation_config, self.model),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=kv_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                num_lookahead_slots=lookahead,
            ),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.disable_comm_overlap,
                self.nnodes,
                self.node_rank,
                self.master_addr,
                self.master_port,
            ),
            device=DeviceConfig(
                device,
                self.enforce_eager,
                self.attention_backend or envs.PAGEDLLM_ATTENTION_BACKEND(),
            ),
            partition=self._partition_config(),
            speculative=speculative,
        )

    def _speculative_config(self, hf_config: Any) -> SpeculativeConfig | None:
        spec = parse_speculative_config(self.speculative_config)
        if spec is None:
            return None
        if self.partition is not None:
            raise ValueError("speculative_config is not supported with an edge/cloud partition.")
        if spec.method == "draft_model":
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "speculative_config.model (a draft model) needs tensor_parallel_size 1."
                )
            draft_vocab = load_hf_config(spec.model).vocab_size
            if draft_vocab != hf_config.vocab_size:
                raise ValueError(
                    f"speculative_config.model has a vocabulary of {draft_vocab} tokens, the "
                    f"target model {hf_config.vocab_size}: they must share one tokenizer."
                )
        return spec

    def _partition_config(self) -> PartitionConfig | None:
        if self.partition is None:
            return None
        role = self.partition_role
        if role not in ("edge", "cloud") and not (role[:4] == "tier" and role[4:].isdigit()):
            raise ValueError(
                f"partition_role must be 'edge', 'cloud' or 'tierN' (a tier in between), "
                f"got {role!r}."
            )
        if self.partition_pipeline_depth < 1:
            raise ValueError(
                f"partition_pipeline_depth must be at least 1, got {self.partition_pipeline_depth}."
            )
        if self.partition_replan_interval < 0:
            raise ValueError(
                "partition_replan_interval must be 0 (never) or a number of steps, got "
                f"{self.partition_replan_interval}."
            )
        if self.partition_fallback not in ("fail", "local"):
            raise ValueError(
                f"partition_fallback must be 'fail' or 'local', got {self.partition_fallback!r}."
            )
        return PartitionConfig(
            self.partition,
            self.partition_role,
            self.partition_address,
            self.partition_pipeline_depth,
            self.partition_replan_interval,
            self.partition_fallback,
        )

    def _verify(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face model folder.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        positive = ("block_size", "max_num_seqs", "tensor_parallel_size", "nnodes")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self._verify_parallel()
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(
                f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}."
            )
        self.requested_quant_config()  # validates the quant_* options
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")

    def _verify_parallel(self) -> None:
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                f"nnodes ({self.nnodes}): every node hosts the same number of ranks."
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}.")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}.")

    def requested_quant_config(self) -> QuantConfig:
        return QuantConfig(
            quant_dtype=self.quantization or "int8",
            observer_type=self.quant_observer,
            granularity=self.quant_granularity,
            enable_activation=self.quant_activation,
            exclude_layers=tuple(self.quant_exclude or ()),
            smoothquant_alpha=None if self.quant_smoothing else 0.0,
        )

    def _quant_config(self, hf_config: Any) -> QuantConfig | None:
        """The requested int8 config; a checkpoint saved quantized fixes its weight options."""
        saved = getattr(hf_config, "quantization_config", None)
        if not (isinstance(saved, dict) and saved.get("quant_method") == QUANT_METHOD):
            return self.requested_quant_config() if self.quantization else None
        return dataclasses.replace(
            self.requested_quant_config(),
            quant_dtype="int8",
            granularity=saved["granularity"],
            exclude_layers=tuple(saved["exclude_layers"]),
            # Checkpoints written before the LM head and embedding were kept hold them in int8.
            quantize_embeddings=saved.get("quantize_embeddings", True),
            smoothquant_alpha=0.0,  # written tensor by tensor, without a calibration pass
            prequantized=True,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def architecture_of(hf_config: Any) -> str:
    """The model class a Hugging Face config names (Llama when it names none)."""
    archs = getattr(hf_config, "architectures", None) or [DEFAULT_ARCHITECTURE]
    return archs[0]


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
    from pagedllm.hf_config import read_hf_config

    return read_hf_config(path)


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
    if name not in ("float32", "bfloat16", "float16"):
        return "float32"
    if device == "cpu" and name != "float32":
        # Half-precision matmuls are only fast with native CPU support (AVX512-BF16 / AMX);
        # elsewhere they run several times slower than float32, so compute in float32.
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return name


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def default_kv_cache_bytes() -> int:
    return _CPU_KV_CACHE_DEFAULT_BYTES

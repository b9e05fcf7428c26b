"""User-facing EngineArgs (vLLM's names) and the frozen configs each component receives."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.cpu_info import cpu_flags
from pagedllm.dtypes import DTYPE_BYTES, FLOAT_DTYPES
from pagedllm.generation_config import generation_config_folder
from pagedllm.hf_config import model_kind
from pagedllm.json_config import config_dict
from pagedllm.kv_events_config import KVEventsConfig, parse_kv_events_config
from pagedllm.spec_config import SpeculativeConfig, parse_speculative_config

_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_DTYPES = ("auto", *FLOAT_DTYPES, *_DTYPE_ALIASES)
# kv_cache_dtype also takes vLLM's short names
_KV_CACHE_DTYPE_ALIASES = {**_DTYPE_ALIASES, "bf16": "bfloat16", "fp16": "float16"}
_KV_CACHE_DTYPES = ("auto", *FLOAT_DTYPES, *_KV_CACHE_DTYPE_ALIASES)
_CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"  # for a config.json that names no architecture
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "none")  # EngineArgs.quantization
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
    # The LM head (weight-only: its inputs stay in full precision) and the token embedding;
    # None: int8 rows with int8 and int4 alike (False keeps them, as vLLM does).
    quantize_embeddings: bool | None = None
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
    model: str  # local Hugging Face folder or GGUF file (a hub id resolved to its snapshot)
    tokenizer: str
    hf_config: Any  # pagedllm.hf_config.HFConfig (transformers.PretrainedConfig for other types)
    dtype: str  # "float32" | "bfloat16" | "float16"
    seed: int
    layer_range: tuple[int, int] | None = None  # decoder layers of a partition tier; None: all
    quant_config: QuantConfig | None = None  # int8 quantization; None: full precision
    gguf_blocks: bool = False  # a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 tensors kept in their blocks
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
    cache_dtype: str = "auto"  # the K/V's dtype: "auto" is the model's (EngineArgs.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # the one copy: the scheduler stops sequences here, the engine checks
    enable_chunked_prefill: bool
    num_lookahead_slots: int = 0  # KV slots past a step's tokens (drafts, or steps run ahead)
    max_loras: int = 0  # most LoRA adapters among the running sequences (0: LoRA off)
    num_scheduler_steps: int = 1  # decode steps a greedy batch may run per schedule


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    disable_comm_overlap: bool = False
    nnodes: int = 1  # machines the tensor-parallel ranks are spread over
    node_rank: int = 0  # this machine's index; node 0 runs the engine (rank 0)
    master_addr: str | None = None  # rendezvous host (default: MASTER_ADDR, else 127.0.0.1)
    master_port: int = 0  # rendezvous port (0: MASTER_PORT, else a free one on one node)
    overlap_min_tokens: int = 128  # smallest step split for overlap (PAGEDLLM_OVERLAP_MIN_TOKENS)


@dataclass(frozen=True)
class KernelConfig:
    """How ops and steps run, resolved once from the environment by create_engine_config."""

    cpu_fused_ops: bool = True  # PAGEDLLM_CPU_FUSED_OPS: ops take their C++ forward_cpu
    cpu_fused_decoder: bool = True  # PAGEDLLM_CPU_FUSED_DECODER: the runner's fused decoder
    attention_tiles: str | None = None  # PAGEDLLM_ATTENTION_TILES: tile overrides
    cpu_huge_pages: bool = True  # PAGEDLLM_CPU_HUGE_PAGES: a CPU model's weights on 2 MB pages
    cuda_fused_ops: bool = False  # PAGEDLLM_CUDA_FUSED_OPS=1: ops take their Triton forward_cuda


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" | "cuda"
    # True: steps run the model's modules as they are (CPU: no fused decoder; CUDA: no graphs)
    enforce_eager: bool
    attention_backend: str | None  # None: chosen for the device
    kernels: KernelConfig = KernelConfig()


@dataclass(frozen=True)
class PartitionConfig:
    """This process's tier of an edge/cloud split. Plain settings only: the plan itself is
    read by pagedllm.partition (the split executor / cloud worker), not here."""

    plan: str  # path of the PartitionPlan JSON
    role: str = "edge"  # "edge" (embedding, layers [0, cut), the engine) | "cloud" (the rest)
    address: str | None = None  # edge: the cloud worker's host:port; cloud: where to listen
    pipeline_depth: int = 1  # edge: engine steps (micro-batches) in flight across the tiers
    replan_interval: int = 64  # edge: steps between re-plans from measurements (0: never)
    fallback: str = "fail"  # edge, a lost link: "fail" the running requests | run them "local"


def parse_partition_config(raw: dict[str, Any] | None) -> PartitionConfig | None:
    """EngineArgs.partition_config (a dict) as a PartitionConfig; ValueError names the key."""
    if raw is None:
        return None
    unknown = sorted(set(raw) - set(_PARTITION_KEYS))
    if unknown:
        raise ValueError(
            f"partition_config has unknown keys {unknown}; known: {list(_PARTITION_KEYS)}."
        )
    if not isinstance(raw.get("plan"), str) or not raw["plan"]:
        raise ValueError("partition_config.plan (the partition plan's JSON file) is required.")
    config = PartitionConfig(**raw)
    role = config.role
    tier = isinstance(role, str) and role[:4] == "tier" and role[4:].isdigit()
    if role not in ("edge", "cloud") and not tier:
        raise ValueError(
            f"partition_config.role must be 'edge', 'cloud' or 'tierN' (a tier in between), "
            f"got {role!r}."
        )
    if config.address is not None and not isinstance(config.address, str):
        raise ValueError(f"partition_config.address must be HOST:PORT, got {config.address!r}.")
    for key, low in (("pipeline_depth", 1), ("replan_interval", 0)):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"partition_config.{key} must be an integer >= {low}, got {value!r}.")
    if config.fallback not in ("fail", "local"):
        raise ValueError(
            f"partition_config.fallback must be 'fail' or 'local', got {config.fallback!r}."
        )
    return config


_PARTITION_KEYS = tuple(f.name for f in dataclasses.fields(PartitionConfig))


def partition_config_dict(raw: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """partition_config as given (a dict or its JSON text) as a dict; ValueError."""
    return config_dict(raw, "partition_config")


def _merge_deprecated_partition_fields(args: EngineArgs) -> dict[str, Any] | None:
    """partition_config as a dict (parsed from JSON text), with the deprecated partition_*
    fields moved into it (each then None, so dataclasses.replace sees them once)."""
    raw = partition_config_dict(args.partition_config)
    old = {
        key: getattr(args, name)
        for name, key in DEPRECATED_PARTITION_FIELDS.items()
        if getattr(args, name) is not None
    }
    if not old:
        return raw
    names = [n for n, key in DEPRECATED_PARTITION_FIELDS.items() if key in old]
    warnings.warn(
        f"the EngineArgs fields {', '.join(names)} are deprecated and will be removed in the next "
        f"release; pass partition_config={{{', '.join(repr(k) + ': ...' for k in old)}}}.",
        DeprecationWarning,
        stacklevel=4,
    )
    for name in names:
        setattr(args, name, None)
    return {**old, **(raw or {})}


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (enable_lora): adapters resident at once and the largest rank they take."""

    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    partition: PartitionConfig | None = None  # None: the whole model in this process
    speculative: SpeculativeConfig | None = None  # None: one token per step and sequence
    kv_events: KVEventsConfig | None = None  # None: no KV-cache events published
    lora: LoRAConfig | None = None  # None: no adapters (enable_lora off)


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


def _arg(default: Any = None, help: str = "", **kwargs: Any) -> Any:
    """An EngineArgs field and its command-line help (the CLI reads metadata["help"])."""
    return field(default=default, metadata={"help": help, **kwargs})


# EngineArgs fields replaced by partition_config: field -> its key there. Accepted (with a
# DeprecationWarning) for one release.
DEPRECATED_PARTITION_FIELDS = {
    "partition": "plan",
    "partition_role": "role",
    "partition_address": "address",
    "partition_pipeline_depth": "pipeline_depth",
    "partition_replan_interval": "replan_interval",
    "partition_fallback": "fallback",
}


@dataclass
class EngineArgs:
    """Arguments of an LLMEngine, named and defaulted as vLLM's EngineArgs. Each field's
    metadata["help"] is its command-line help (``--block-size`` for block_size ...)."""

    model: str = field(
        default_factory=default_model_path,
        metadata={
            "help": "Hugging Face model folder, GGUF file or hub id (default: generate, chat "
            "and serve fetch SmolLM2-135M-Instruct on first use; other tools: the bundled "
            "demo model)"
        },
    )
    tokenizer: str | None = _arg(
        None, "tokenizer folder, GGUF file or hub id (default: the model's)"
    )
    revision: str | None = _arg(None, "hub ids: the branch, tag or commit to load")
    dtype: str = _arg(
        "auto",
        "auto | float32 | bfloat16 | float16; auto: the model's (config.json's torch_dtype, a "
        "GGUF file's float matrices, float32 for a quantized GGUF), half precision on a CPU "
        "as bfloat16 where it multiplies bf16 natively, else float32",
    )
    seed: int = _arg(0, "random seed")
    max_model_len: int | None = _arg(
        None, "longest prompt + output, in tokens (default: the model's)"
    )
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_num_seqs: int = _arg(256, "most sequences in one batch")
    # Tokens computed per step. A value below max_num_seqs also caps the batch at that many
    # sequences (each running sequence decodes one token a step), so prompts really chunk.
    max_num_batched_tokens: int | None = _arg(
        None,
        "most tokens computed in one step (below max_num_seqs, also the most sequences in "
        "one batch; default: 2048)",
    )
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory to use (CUDA)")
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV-cache budget in bytes (CPU default: 4 GiB, at most 40%% of free RAM)"
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "auto (the model's dtype) | bfloat16 | float16 | float32: the dtype the KV cache "
        "stores keys and values in; attention then runs in it (bfloat16 or float16 halves an "
        "fp32 model's cache; float16 is llama.cpp's default)",
    )
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _arg(
        True, "split long prompts into chunks that share steps with decode"
    )
    num_scheduler_steps: int = _arg(
        1,
        "decode steps run per schedule where every sequence of the batch decodes greedily "
        "(no logprobs, penalties or grammar) on the CPU's fused decoder: the host's work of a "
        "step paid once for up to this many tokens; streams then get tokens in bursts and "
        "new requests wait for a burst to end (default 1: a schedule a token)",
    )
    tensor_parallel_size: int = _arg(1, "number of tensor-parallel workers")
    enforce_eager: bool = _arg(False, "never capture CUDA graphs (run every step eagerly)")
    quantization: str | None = _arg(
        None,
        "None | int8 (int8 x int8 products; down_proj and the LM head int8 weight-only, the "
        "embedding int8 rows) | int4 (weight-only, group scales, vLLM's rtn at 4 bits; the LM "
        "head and embedding as int8 has them) | gguf (a GGUF file's "
        "Q4_0 / Q4_1 / Q4_K / Q8_0 tensors kept in their blocks: what None does for a GGUF "
        "file on a CPU) | none (a GGUF file dequantized to --dtype)",
    )
    device: str = _arg("auto", "auto | cpu | cuda")
    attention_backend: str | None = _arg(
        None, "torch | cpu | triton (default: chosen for the device)"
    )
    disable_comm_overlap: bool = _arg(
        False, "do not overlap tensor-parallel all-reduce with compute"
    )
    nnodes: int = _arg(1, "machines the tensor-parallel ranks span (each runs this command)")
    node_rank: int = _arg(0, "this machine's index among --nnodes; node 0 runs the engine")
    master_addr: str | None = _arg(
        None, "rendezvous host, node 0's address (default: MASTER_ADDR or 127.0.0.1)"
    )
    master_port: int = _arg(0, "rendezvous port (0: MASTER_PORT, else a free port on one node)")
    partition_config: dict[str, Any] | str | None = _arg(
        None,
        "run one tier of an edge/cloud split, as JSON: plan (the plan file of `pagedllm "
        "partition -o`), role (edge | cloud | tierN), address, pipeline_depth, "
        "replan_interval, fallback (fail | local); the --partition-* flags set the same keys",
    )
    # Deprecated: one key of partition_config each (DEPRECATED_PARTITION_FIELDS).
    partition: str | None = _arg(
        None, "partition plan JSON (pagedllm partition -o): run one tier of a split"
    )
    partition_role: str | None = _arg(
        None, "edge (the engine, embedding and layers [0, cut)) | cloud (the rest) (default: edge)"
    )
    partition_address: str | None = _arg(
        None, "edge: the cloud worker's HOST:PORT; cloud: HOST:PORT to listen on"
    )
    partition_pipeline_depth: int | None = _arg(
        None, "edge: micro-batches in flight across the tiers (default: 1, none)"
    )
    partition_replan_interval: int | None = _arg(
        None,
        "edge: steps between re-planning the cut from what the split measures, moving it "
        "when the optimum moves (0: never; default: 64)",
    )
    partition_fallback: str | None = _arg(
        None,
        "edge, when the link to the cloud is lost: fail (the running requests end with an "
        "error) | local (every layer runs here until the link returns) (default: fail)",
    )
    quant_exclude: list[str] | None = _arg(
        None,
        "int8: module name or pattern kept in full precision, e.g. lm_head, "
        "'*.self_attn.*' (repeatable)",
    )
    quant_granularity: str = _arg("per_channel", "int8 weight scales: per_channel | per_tensor")
    quant_observer: str = _arg(
        "minmax", "int8 activation scales: minmax (per token) | moving_average"
    )
    quant_activation: bool = _arg(
        True,
        "int8: quantize activations too (int8 x int8 matmuls); --no-quant-activation: weight-only",
    )
    quant_smoothing: bool = _arg(
        True,
        "int8: migrate activation outliers into the weights (SmoothQuant) from a calibration "
        "pass over pydoc text; --no-quant-smoothing: none (as saved checkpoints)",
    )
    quant_embeddings: bool = _arg(
        True,
        "int8 and int4: the LM head too, with int8 weights and full-precision inputs (as a "
        "Q8_0 GGUF file has it), and the token embedding; --no-quant-embeddings keeps both in "
        "--dtype, as vLLM does",
    )
    speculative_config: dict[str, Any] | str | None = _arg(
        None,
        "speculative decoding as JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}\'',
    )
    kv_events_config: dict[str, Any] | str | None = _arg(
        None,
        "publish KV-cache events for prefix-aware routers, vLLM's JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
    )
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT format) beside the base model")
    max_loras: int = _arg(1, "LoRA adapters resident at once (and in one batch)")
    max_lora_rank: int = _arg(16, "largest LoRA rank an adapter may have")
    generation_config: str = _arg(
        "auto",
        "default sampling parameters: auto (the model folder's generation_config.json), "
        "pagedllm (the SamplingParams defaults) or a folder holding a generation_config.json",
    )

    def __post_init__(self) -> None:
        self.partition_config = _merge_deprecated_partition_fields(self)
        self.dtype = _dtype_name(self.dtype)

    def create_engine_config(self) -> EngineConfig:
        self._verify()
        from pagedllm.hub import resolve_model

        model = resolve_model(self.model, self.revision)
        tokenizer = resolve_model(self.tokenizer, self.revision) if self.tokenizer else model
        hf_config = load_hf_config(model)
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
        lookahead = max(lookahead, self.num_scheduler_steps - 1)
        return EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                hf_config=hf_config,
                dtype=_resolve_dtype(self.dtype, hf_config, device),
                seed=self.seed,
                quant_config=self._quant_config(hf_config),
                gguf_blocks=self._gguf_blocks(model, device),
                generation_config=generation_config_folder(self.generation_config, model),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=kv_bytes,
                cache_dtype=_resolve_cache_dtype(self.kv_cache_dtype),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                num_lookahead_slots=lookahead,
                max_loras=self.max_loras if self.enable_lora else 0,
                num_scheduler_steps=self.num_scheduler_steps,
            ),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.disable_comm_overlap,
                self.nnodes,
                self.node_rank,
                self.master_addr,
                self.master_port,
                envs.PAGEDLLM_OVERLAP_MIN_TOKENS(),
            ),
            device=DeviceConfig(
                device,
                self.enforce_eager,
                self.attention_backend or envs.PAGEDLLM_ATTENTION_BACKEND(),
                KernelConfig(
                    envs.PAGEDLLM_CPU_FUSED_OPS(),
                    envs.PAGEDLLM_CPU_FUSED_DECODER(),
                    envs.PAGEDLLM_ATTENTION_TILES(),
                    envs.PAGEDLLM_CPU_HUGE_PAGES(),
                    envs.PAGEDLLM_CUDA_FUSED_OPS(),
                ),
            ),
            partition=parse_partition_config(self.partition_config),
            speculative=speculative,
            kv_events=parse_kv_events_config(self.kv_events_config),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank) if self.enable_lora else None,
        )

    def _speculative_config(self, hf_config: Any) -> SpeculativeConfig | None:
        spec = parse_speculative_config(self.speculative_config)
        if spec is None:
            return None
        if self.partition_config is not None:
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

    def _verify(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "model must be a Hugging Face model folder, a GGUF file or a hub id (org/name)."
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            fp8 = " (fp8 caches are not supported)" if "fp8" in str(self.kv_cache_dtype) else ""
            raise ValueError(
                f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got "
                f"{self.kv_cache_dtype!r}{fp8}."
            )
        positive = (
            "block_size", "max_num_seqs", "tensor_parallel_size", "nnodes", "num_scheduler_steps"
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self._verify_parallel()
        self._verify_lora()
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ValueError("num_scheduler_steps > 1 is not supported with speculative_config.")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}."
            )
        self.requested_quant_config()  # validates the quant_* options
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")

    def _verify_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.enable_lora and self.partition_config is not None:
            raise ValueError("enable_lora is not supported with an edge/cloud partition.")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora is not supported with speculative_config.")

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
            quant_dtype=self.quantization if self.quantization in ("int8", "int4") else "int8",
            observer_type=self.quant_observer,
            granularity=self.quant_granularity,
            enable_activation=self.quant_activation,
            exclude_layers=tuple(self.quant_exclude or ()),
            smoothquant_alpha=None if self.quant_smoothing else 0.0,
            quantize_embeddings=None if self.quant_embeddings else False,
        )

    def _gguf_blocks(self, model: str, device: str) -> bool:
        """Whether the GGUF file's quantized tensors stay in their blocks (the weight-only CPU
        kernels run them, on one rank); quantization 'none' or another method dequantizes."""
        if model_kind(model) != "gguf":
            if self.quantization == "gguf":
                raise ValueError(f"quantization 'gguf' needs a GGUF file, got {model!r}.")
            return False
        keep = self.quantization in (None, "gguf")
        if keep and (device != "cpu" or self.tensor_parallel_size > 1):
            if self.quantization == "gguf":
                raise ValueError("quantization 'gguf' runs on one CPU rank (device cpu, tp 1).")
            return False
        return keep

    def _quant_config(self, hf_config: Any) -> QuantConfig | None:
        """The requested int8 config; a checkpoint saved quantized fixes its weight options."""
        saved = getattr(hf_config, "quantization_config", None)
        if not (isinstance(saved, dict) and saved.get("quant_method") == QUANT_METHOD):
            return self.requested_quant_config() if self.quantization in ("int8", "int4") else None
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
    """The config of a local model folder or GGUF file, with clear errors for the usual
    mistakes."""
    from pagedllm.hf_config import read_model_config

    return read_model_config(model)


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


def _resolve_cache_dtype(name: str) -> str:
    """kv_cache_dtype as CacheConfig keeps it: "auto" or a FLOAT_DTYPES name."""
    return _KV_CACHE_DTYPE_ALIASES.get(name, name)


def _dtype_name(dtype: Any) -> Any:
    """A torch.dtype given for dtype (vLLM takes both) as its name: torch.bfloat16 ->
    "bfloat16"; anything else as given, for _verify to judge."""
    text = str(dtype)
    if not isinstance(dtype, str) and text.startswith("torch."):
        return text.removeprefix("torch.")
    return dtype


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    if dtype != "auto":
        return _DTYPE_ALIASES.get(dtype, dtype)
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(config_dtype).replace("torch.", "") if config_dtype is not None else "float32"
    if name not in FLOAT_DTYPES:
        return "float32"
    if device == "cpu" and name != "float32":
        # Half-precision matmuls are only fast with native CPU support (AVX512-BF16 / AMX);
        # elsewhere they run several times slower than float32, so compute in float32.
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return name


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def default_kv_cache_bytes() -> int:
    return _CPU_KV_CACHE_DEFAULT_BYTES

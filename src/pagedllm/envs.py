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


def PAGEDLLM_CPU_KVCACHE_SPACE_BYTES() -> int | None:  # noqa: N802
    """The CPU KV-cache budget, set in GiB like vLLM's VLLM_CPU_KVCACHE_SPACE (fractions
    allowed); unset or 0: the default. An explicit kv_cache_memory_bytes takes precedence."""
    value = os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE")
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ValueError(f"PAGEDLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}.")
    return int(gib * (1 << 30)) or None


def PAGEDLLM_TP_TIMEOUT() -> float:  # noqa: N802
    """Seconds a tensor-parallel collective may wait for a peer before the engine fails."""
    return float(os.environ.get("PAGEDLLM_TP_TIMEOUT", "300"))


def PAGEDLLM_OVERLAP_MIN_TOKENS() -> int:  # noqa: N802
    """Smallest step (in tokens) that tensor parallel splits into overlapping micro-batches."""
    return int(os.environ.get("PAGEDLLM_OVERLAP_MIN_TOKENS", "128"))


def MASTER_ADDR() -> str | None:  # noqa: N802 - torch.distributed's rendezvous variables
    return os.environ.get("MASTER_ADDR") or None


def MASTER_PORT() -> int | None:  # noqa: N802
    value = os.environ.get("MASTER_PORT")
    return int(value) if value else None


def launcher_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when a launcher such as torchrun started this process, else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return (int(rank), int(world)) if rank and world else None


def PAGEDLLM_ATTENTION_TILES() -> str | None:  # noqa: N802
    """Attention tile overrides, e.g. "block_m=32,block_n=64,num_stages=2,split_keys=512"."""
    return os.environ.get("PAGEDLLM_ATTENTION_TILES") or None


def PAGEDLLM_CPU_NATIVE_ARCH() -> bool:  # noqa: N802
    """Build the CPU attention kernels for this machine's instruction set (default on)."""
    return os.environ.get("PAGEDLLM_CPU_NATIVE_ARCH", "1") != "0"


def TORCH_EXTENSIONS_DIR() -> str | None:  # noqa: N802 - torch's own variable, read here too
    """Where compiled C++ extensions are cached (torch's default: ~/.cache/torch_extensions)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or None


def XDG_CACHE_HOME() -> str | None:  # noqa: N802
    return os.environ.get("XDG_CACHE_HOME") or None


def HF_HUB_OFFLINE() -> bool:  # noqa: N802 - huggingface_hub's own variable, read here too
    """Offline mode: the hub cache only, and no first-run download of the default model."""
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")


def TRITON_INTERPRET() -> bool:  # noqa: N802 - Triton's own variable, read here too
    """Triton runs kernels in its CPU interpreter (tests of the GPU kernels without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def PAGEDLLM_CPU_FUSED_OPS() -> bool:  # noqa: N802
    """Use the C++ fused residual + RMSNorm and rotary kernels on CPU (default on); 0 takes
    the torch ops, e.g. to measure what the fusion is worth."""
    return os.environ.get("PAGEDLLM_CPU_FUSED_OPS", "1") != "0"


def PAGEDLLM_CUDA_FUSED_OPS() -> bool:  # noqa: N802
    """1: the Triton residual + RMSNorm, SwiGLU and rotary kernels on CUDA (layers/
    triton_ops.py) in place of the torch ops. Off by default until tools/gpu_check.sh has
    passed with them on a GPU (their tests so far ran in Triton's CPU interpreter)."""
    return os.environ.get("PAGEDLLM_CUDA_FUSED_OPS", "0") == "1"


def PAGEDLLM_CPU_PANEL_WEIGHTS() -> bool:  # noqa: N802
    """Store CPU float linear weights in panels for the C++ panel GEMM (default on where the
    CPU has AVX-512); 0 keeps them plain (the one-row GEMV and ATen's GEMM), e.g. to A/B it."""
    return os.environ.get("PAGEDLLM_CPU_PANEL_WEIGHTS", "1") != "0"


def PAGEDLLM_CPU_INT8_ACTIVATIONS() -> bool:  # noqa: N802
    """Weight-only layers with codes in panels multiply x as int8 on AVX512-VNNI (default on
    where the CPU has it): a GGUF file's linears up to 4 rows of x rounded per block of 32
    (llama.cpp's way), every other one (LM heads, the int4 format's layers) one row as two
    int8 parts (fp32 x's accuracy); 0 keeps x in fp32 against the unpacked codes."""
    return os.environ.get("PAGEDLLM_CPU_INT8_ACTIVATIONS", "1") != "0"


def PAGEDLLM_CPU_BF16_DOT_ATTENTION() -> bool:  # noqa: N802
    """bf16 attention on vdpbf16ps where the CPU has AVX512-BF16 (default on); 0 takes the
    kernel's vector-extension path, which converts K/V rows to fp32, e.g. to A/B it."""
    return os.environ.get("PAGEDLLM_CPU_BF16_DOT_ATTENTION", "1") != "0"


def PAGEDLLM_CPU_AMX_ATTENTION() -> bool:  # noqa: N802
    """The bf16 attention path's many-row products on AMX tiles where the CPU has AMX-BF16
    (default on); 0 keeps them on vdpbf16ps, e.g. to A/B it."""
    return os.environ.get("PAGEDLLM_CPU_AMX_ATTENTION", "1") != "0"


def PAGEDLLM_CPU_FUSED_DECODER() -> bool:  # noqa: N802
    """Run a CPU model's decoder layers in one C++ call per step (default on; needs the fused
    ops); 0 runs them module by module in Python (the same kernels, the same results)."""
    return os.environ.get("PAGEDLLM_CPU_FUSED_DECODER", "1") != "0"


def PAGEDLLM_CPU_HUGE_PAGES() -> bool:  # noqa: N802
    """Move a CPU model's weights, once loaded, into memory advised for 2 MB pages (default on;
    worker/huge_pages.py); 0 leaves them where loading put them, on 4 KB pages."""
    return os.environ.get("PAGEDLLM_CPU_HUGE_PAGES", "1") != "0"


def PAGEDLLM_SPLIT_REPLY_TIMEOUT() -> float:  # noqa: N802
    """Seconds the edge of a split waits for a tier's reply to one step before it declares
    the link lost (fails the running requests, reconnects on a later step)."""
    return float(os.environ.get("PAGEDLLM_SPLIT_REPLY_TIMEOUT", "60"))

"""Helpers shared by the benchmarks: the 125M benchmark model and machine description."""

from __future__ import annotations

import os
import platform
from pathlib import Path

BENCH_125M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def build_bench_model(folder: Path, seed: int = 0) -> Path:
    """The 125M-parameter Llama benchmark model (random weights, bfloat16), built once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**BENCH_125M)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def default_model_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_BENCH_DIR", "bench_out")) / "llama-125m"


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}"
    )

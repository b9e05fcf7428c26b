"""PAGEDLLM_CPU_KVCACHE_SPACE sizes the CPU KV cache in GiB, like VLLM_CPU_KVCACHE_SPACE."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

GIB = 1 << 30


def test_env_sets_the_cpu_kv_budget_and_the_block_count(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.0005")  # about 512 KiB
    args = EngineArgs(model=str(tiny_llama), device="cpu", dtype="float32", block_size=4)
    assert args.create_engine_config().cache.kv_cache_memory_bytes == int(0.0005 * GIB)
    engine = LLMEngine.from_engine_args(args, skip_tokenizer_init=True)
    spec = engine.kv_cache
    assert spec.num_blocks == int(0.0005 * GIB) // spec.bytes_per_block  # the budget binds
    assert engine.block_manager.num_blocks == spec.num_blocks


def test_explicit_bytes_win_and_bad_values_are_refused(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "2")
    args = EngineArgs(model=str(tiny_llama), device="cpu", kv_cache_memory_bytes=1 << 20)
    assert args.create_engine_config().cache.kv_cache_memory_bytes == 1 << 20
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE"):
        EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()


def test_unset_or_zero_keeps_the_default(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0")
    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    assert config.cache.kv_cache_memory_bytes is None  # the runner's CPU default applies

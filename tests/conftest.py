"""Shared fixtures; the builders they use live in helpers.models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.models import build_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items(), key=str)))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_model(folder, arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="module")
def small_runner(tiny_llama):  # noqa: ANN201
    """A ModelRunner over the tiny llama in fp32, blocks of 4, a 16-block cache: for building
    steps' inputs by hand (prepare_input)."""
    from pagedllm.config import EngineArgs
    from pagedllm.worker.model_runner import ModelRunner

    args = EngineArgs(str(tiny_llama), dtype="float32", block_size=4)
    runner = ModelRunner.from_engine_config(args.create_engine_config())
    runner.allocate_kv_cache(16)
    return runner

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

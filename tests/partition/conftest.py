"""Fixtures of the partition tests: cloud workers in subprocesses, stopped afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.partition import Worker, launch_worker, ready


@pytest.fixture
def workers():
    """Start cloud workers (start(model_dir, plan, *flags)); all are stopped afterwards."""
    started: list[Worker] = []

    def start(model_dir: Path, plan: Path, *extra: str, address: str = "127.0.0.1:0") -> Worker:
        started.append(ready(launch_worker(model_dir, plan, *extra, address=address)))
        return started[-1]

    yield start
    for w in started:
        w.kill()

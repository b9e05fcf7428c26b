"""Fixtures of the reliability tests: an HTTP server on the tiny model, its engine at hand."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from helpers.engine import MODEL, assert_no_leak, engine_args

from pagedllm import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread


@dataclass
class Served:
    """A server running in a thread of the test process, with its engine at hand."""

    url: str
    app: Any

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.app.state.engine

    def on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return self.engine.submit(fn).result(timeout=60)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until the engine holds no request, then check that nothing leaked."""
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.02)
        self.on_engine(assert_no_leak)


@pytest.fixture(scope="module")
def serve(tiny_llama) -> Iterator[Callable[..., Served]]:
    """serve(**build_app options) -> a running Served; all are stopped at module end."""
    stack: list[Any] = []

    def start(args: EngineArgs | None = None, **options: Any) -> Served:
        options.setdefault("log_stats_interval", None)
        app = build_app(args or engine_args(tiny_llama), [MODEL], **options)
        context = serve_in_thread(app)
        url = context.__enter__()
        stack.append(context)
        return Served(url, app)

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)

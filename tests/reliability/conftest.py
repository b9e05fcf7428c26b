"""Helpers of the reliability tests: an engine and an HTTP server on the tiny model, and the
"nothing leaked" check (integrity holds, no request left, KV usage back to 0)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

MODEL = "tiny"
MAX_MODEL_LEN = 128
ROOMY_KV = 1 << 22  # 8192 token slots of the tiny model: never preempts in these tests
BLOCK_BYTES = 8192  # one 16-token KV block of the tiny model (2 layers, K and V, fp32)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine_args(model: Path, **overrides: Any) -> EngineArgs:
    kwargs: dict[str, Any] = dict(
        model=str(model), kv_cache_memory_bytes=ROOMY_KV, max_model_len=MAX_MODEL_LEN
    )
    return EngineArgs(**{**kwargs, **overrides})


def assert_no_leak(engine: LLMEngine) -> None:
    """Nothing left behind: invariants hold, no request is left, no block is referenced."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests(), list(engine.requests)
    assert engine.block_manager.usage == 0.0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def run_to_end(engine: LLMEngine, max_steps: int = 5000) -> dict[str, list[int]]:
    """Step until idle; the final token ids of every request that finished, by request id."""
    finals: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    raise AssertionError("the engine did not finish its requests")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **GREEDY)


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


def sse_events(raw: str) -> list[Any]:
    """The events of a server-sent event stream, asserting OpenAI's framing."""
    blocks = raw.split("\n\n")
    assert blocks[-1] == "", "the stream does not end with a blank line"
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        body = block[len("data: ") :]
        events.append(body if body == "[DONE]" else json.loads(body))
    return events

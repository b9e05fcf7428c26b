"""Engines on the tiny model: their arguments, the "nothing leaked" check, running to the end,
and faults injected into the model step."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import EngineArgs
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.llm_engine import LLMEngine

MODEL = "tiny"  # the name the test servers serve the tiny model under
MAX_MODEL_LEN = 128
ROOMY_KV = 1 << 22  # 8192 token slots of the tiny model: never preempts in these tests
BLOCK_BYTES = 8192  # one 16-token KV block of the tiny model (2 layers, K and V, fp32)

# (call number from 1, the step's scheduler output) -> the error to raise, or None
Fault = Callable[[int, SchedulerOutput], BaseException | None]


def engine_args(model: Path | str, **overrides: Any) -> EngineArgs:
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


def on_call(n: int, error: BaseException) -> Fault:
    """A fault that raises error on the n-th model step from now, once."""
    return lambda call, _out: error if call == n else None


def patch_execute_model(
    monkeypatch: pytest.MonkeyPatch,
    executor: Any,
    *,
    delay: float = 0.0,
    fault: Fault | None = None,
) -> None:
    """Wrap executor.execute_model: each step sleeps delay seconds first, then raises what
    fault returns for it, or runs the real step."""
    real = executor.execute_model
    calls = 0

    def wrapped(out: SchedulerOutput) -> Any:
        nonlocal calls
        calls += 1
        time.sleep(delay)
        error = fault(calls, out) if fault is not None else None
        if error is not None:
            raise error
        return real(out)

    monkeypatch.setattr(executor, "execute_model", wrapped)

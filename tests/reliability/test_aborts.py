"""Aborts and disconnects in every state of a request free every block: the engine's invariants
hold after each step, KV usage returns to 0, and the other requests end exactly as they would
have without the abort."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable

import httpx
import pytest
from helpers.engine import (
    BLOCK_BYTES,
    assert_no_leak,
    engine_args,
    patch_execute_model,
    run_to_end,
)
from helpers.generation import GREEDY, greedy_params

from pagedllm import SamplingParams
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.core.stats import FinishedRequestStats, IterationStats, SchedulerStats
from pagedllm.engine.llm_engine import LLMEngine

TIGHT = dict(
    kv_cache_memory_bytes=12 * BLOCK_BYTES,  # 192 token slots for ~400 tokens of work
    max_num_batched_tokens=32,  # prompts above 32 tokens are prefilled in chunks
    max_num_seqs=4,  # the 5th request waits
)
# (prompt length, max_tokens): mixed lengths, sized so that TIGHT preempts.
WORKLOAD = [(70, 30), (12, 40), (40, 20), (25, 35), (90, 10), (8, 25)]

STATES: dict[str, Callable[[Sequence], bool]] = {
    "waiting": lambda s: s.status == SequenceStatus.WAITING,
    "prefill_chunk": lambda s: (
        s.status == SequenceStatus.RUNNING and 0 < s.num_computed_tokens < s.num_prompt_tokens
    ),
    "decoding": lambda s: s.status == SequenceStatus.RUNNING and s.num_output_tokens >= 2,
    "preempted": lambda s: s.status == SequenceStatus.PREEMPTED,
}


def add_workload(engine: LLMEngine) -> None:
    for i, (prompt_len, max_tokens) in enumerate(WORKLOAD):
        prompt = [(7 * i + j) % 300 + 10 for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, greedy_params(max_tokens))
    # n = 2 samples sharing their prompt's blocks, seeded so the output is reproducible
    engine.add_request("siblings", [11, 12, 13] * 7, SamplingParams(n=2, max_tokens=20, seed=3))


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    """The workload's outputs on a cache that holds it all (no preemption)."""
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama))
    add_workload(engine)
    return run_to_end(engine)


@pytest.mark.parametrize("state", list(STATES))
def test_abort_in_each_state_frees_everything(tiny_llama, reference, state: str) -> None:
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama, **TIGHT))
    assert engine.kv_cache.num_blocks == 12
    add_workload(engine)
    aborted, finals = None, {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():  # a step first: "waiting" then means behind running ones
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        if aborted is None:
            aborted = find_request(engine, STATES[state])
            if aborted is not None:
                engine.abort_request(aborted)
                engine.check_integrity()
    assert aborted is not None, f"no request reached the {state} state"
    assert_no_leak(engine)
    expected = {rid: ids for rid, ids in reference.items() if rid != aborted}
    assert finals == expected
    if state == "preempted":
        assert engine.scheduler.num_preemptions > 0


def test_abort_every_request_at_every_step_leaves_nothing(tiny_llama) -> None:
    """Abort one request per step, whatever its state, until none is left."""
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama, **TIGHT))
    add_workload(engine)
    seen: set[SequenceStatus] = set()
    while engine.has_unfinished_requests():
        engine.step()
        if engine.requests:
            rid = sorted(engine.requests)[-1]
            seen.update(s.seq.status for s in engine.requests[rid].seqs)
            engine.abort_request(rid)
        engine.check_integrity()
    assert_no_leak(engine)
    assert {SequenceStatus.WAITING, SequenceStatus.RUNNING} <= seen


# ---- over HTTP: client disconnects ------------------------------------------------------
@pytest.fixture(scope="module")
def server(serve, tiny_llama):
    args = engine_args(tiny_llama, max_num_batched_tokens=16, max_num_seqs=16, max_model_len=256)
    return serve(args)


@pytest.fixture()
def slow_steps(server, monkeypatch):
    """Each step takes >= 50 ms, so a 150-token request takes over 7 s."""
    patch_execute_model(monkeypatch, server.engine.engine.executor, delay=0.05)


def find_request(engine: LLMEngine, in_state: Callable[[Sequence], bool]) -> str | None:
    """The id of a request with a sequence in that state, if any."""
    for request_id, request in engine.requests.items():
        if any(in_state(s.seq) for s in request.seqs):
            return request_id
    return None


def request_state(server, state: str) -> bool:
    return server.on_engine(lambda e: find_request(e, STATES[state]) is not None)


LONG = {"max_tokens": 150, **GREEDY}


PROMPTS = itertools.count(10)  # each request its own prompt: no prefix-cache hit skips a chunk


@pytest.mark.parametrize("state", ["prefill_chunk", "decoding"])
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_everything(server, slow_steps, state: str, stream: bool) -> None:
    first = next(PROMPTS)
    prompt = [first] + list(range(10, 89))  # 80 tokens: five 16-token prefill chunks
    body = {"prompt": prompt, **LONG, "stream": stream}

    async def request_then_leave() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            call = asyncio.create_task(client.post(server.url + "/v1/completions", json=body))
            while not await asyncio.to_thread(request_state, server, state):
                assert not call.done(), call.result().text
                await asyncio.sleep(0.01)
            call.cancel()  # drops the connection, streamed or not
            with contextlib.suppress(asyncio.CancelledError):
                await call

    finished = FinishedRecorder()
    server.on_engine(lambda e: e.add_stat_logger(finished))
    try:
        asyncio.run(asyncio.wait_for(request_then_leave(), timeout=30))
        server.wait_idle(timeout=60.0)
        # an abort is counted with the engine's next step: one more request brings it
        httpx.post(server.url + "/v1/completions", json={"prompt": [7], "max_tokens": 1})
        server.wait_idle(timeout=60.0)
    finally:
        server.on_engine(lambda e: e.stat_loggers.remove(finished))
    left = [r for r in finished.requests if r.num_prompt_tokens == len(prompt)]
    assert [r.finish_reason for r in left] == ["abort"], finished.requests
    assert left[0].num_generation_tokens < LONG["max_tokens"]  # ended, not run to its length


class FinishedRecorder:
    """A stat logger that keeps the statistics of every request the engine finished."""

    def __init__(self) -> None:
        self.requests: list[FinishedRequestStats] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.requests.extend(iteration_stats.finished_requests)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued_frees_everything(server, stream: bool) -> None:
    """The client leaves while its request waits behind a busy engine thread."""
    gate = threading.Event()
    server.engine.submit(lambda e: gate.wait(30))  # holds the engine thread
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "The quick", **LONG, "stream": stream},
                timeout=httpx.Timeout(30, read=0.3),
            )
    finally:
        gate.set()
    server.wait_idle(timeout=10.0)

"""AsyncLLMEngine: concurrent requests share batches, leaving early aborts, errors propagate."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
from helpers.engine import on_call, patch_execute_model

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineError,
    EngineOverloadedError,
)
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.worker.executor import ExecutorLostError


class Recorder:
    """A stat logger remembering the largest running batch and the requests that finished
    (run to the end) or were aborted."""

    def __init__(self) -> None:
        self.max_running = 0
        self.finished = 0
        self.aborted = 0

    def record(self, scheduler_stats, iteration_stats) -> None:  # noqa: ANN001
        self.max_running = max(self.max_running, scheduler_stats.num_running)
        for req in iteration_stats.finished_requests:
            if req.finish_reason == "abort":
                self.aborted += 1
            else:
                self.finished += 1


@pytest.fixture()
def engine(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    engine = AsyncLLMEngine.from_engine_args(args)
    engine.recorder = Recorder()
    engine.engine.add_stat_logger(engine.recorder)
    yield engine
    engine.shutdown()


def idle_state(engine: AsyncLLMEngine) -> tuple[bool, float]:
    """(has unfinished requests, KV usage), read on the engine thread after an integrity check."""

    def read(e):  # noqa: ANN001, ANN202
        e.check_integrity()
        return e.has_unfinished_requests(), e.block_manager.usage

    return engine.submit(read).result(timeout=30)


async def final_text(engine: AsyncLLMEngine, prompt: str, rid: str, max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text = None
    async for out in engine.generate(prompt, params, rid):
        text = out.outputs[0].text
    return text


PROMPTS = [f"The quick brown fox {i}" for i in range(6)] + ["A list is", "Dictionaries map"]


async def queued(engine: AsyncLLMEngine, n: int, timeout: float = 30.0) -> None:
    """Wait until n commands wait for the engine thread (held by the test), then go on."""
    deadline = time.monotonic() + timeout
    while engine._commands.qsize() < n:
        assert time.monotonic() < deadline, f"{engine._commands.qsize()} of {n} queued"
        await asyncio.sleep(0.01)


def test_concurrent_requests_share_a_batch_and_match_one_by_one(engine) -> None:
    # The engine thread waits until every add is queued: all of them join the first step,
    # however the tasks happen to be scheduled.
    gate = threading.Event()
    engine.submit(lambda e: gate.wait(60))

    async def main() -> tuple[list[str], list[str]]:
        tasks = [
            asyncio.ensure_future(final_text(engine, p, f"c{i}")) for i, p in enumerate(PROMPTS)
        ]
        await queued(engine, len(PROMPTS))
        gate.set()
        together = await asyncio.gather(*tasks)
        alone = [await final_text(engine, p, f"s{i}") for i, p in enumerate(PROMPTS)]
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert all(len(t) > 0 for t in together)
    assert engine.recorder.max_running == len(PROMPTS)  # every request in one running batch
    assert idle_state(engine) == (False, 0.0)


def test_leaving_the_iteration_aborts_and_frees_blocks(engine) -> None:
    async def main() -> int:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        seen = 0
        async for out in engine.generate("The quick brown fox", params, "early"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 2:
                break
        return seen

    assert asyncio.run(main()) >= 2
    assert idle_state(engine) == (False, 0.0)
    assert engine.recorder.finished == 0  # aborted, not run to max_tokens
    assert engine.recorder.aborted == 1


def test_cancelled_consumer_aborts(engine) -> None:
    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("The quick brown fox", params, "cancel-me"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert idle_state(engine) == (False, 0.0)
    assert engine.recorder.finished == 0
    assert engine.recorder.aborted == 1


def test_bad_request_raises_value_error_and_others_continue(engine) -> None:
    async def main() -> str:
        good = asyncio.create_task(final_text(engine, "The quick", "good", max_tokens=30))
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([5] * 300, SamplingParams(max_tokens=1), "too-long"):
                pass
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("good", "again", SamplingParams(max_tokens=1))
        return await good

    text = asyncio.run(main())
    alone = asyncio.run(final_text(engine, "The quick", "good-alone", max_tokens=30))
    assert text == alone  # the duplicate id did not abort the running request
    assert idle_state(engine) == (False, 0.0)


def test_waiting_queue_is_bounded(engine) -> None:
    engine.max_waiting_requests = 2
    gate = threading.Event()
    engine.submit(lambda e: gate.wait(30))  # holds the engine thread: the adds queue up

    async def main() -> list[object]:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        adds = [engine.add_request(f"q{i}", "The quick", params) for i in range(3)]
        tasks = [asyncio.ensure_future(a) for a in adds]
        await queued(engine, len(adds))  # every add waits in the command queue
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if not isinstance(r, BaseException):
                async for _ in r.outputs():
                    pass
        return results

    results = asyncio.run(main())
    overloaded = [r for r in results if isinstance(r, EngineOverloadedError)]
    assert len(overloaded) == 1  # two fit the bound of 2 waiting requests, the third does not
    assert "max-waiting-requests" in str(overloaded[0])
    assert idle_state(engine) == (False, 0.0)


@pytest.mark.parametrize("error", [RuntimeError, ExecutorLostError])
def test_engine_error_fails_running_requests_then_recovers(engine, monkeypatch, error) -> None:
    # RuntimeError escapes LLMEngine.step; ExecutorLostError is turned by the engine into
    # outputs with finish_reason "error". Either way the affected requests raise EngineError.
    patch_execute_model(monkeypatch, engine.engine.executor, fault=on_call(3, error("device lost")))

    async def main() -> list[object]:
        return await asyncio.gather(
            final_text(engine, "The quick", "e1", max_tokens=20),
            final_text(engine, "A list", "e2", max_tokens=20),
            return_exceptions=True,
        )

    results = asyncio.run(main())
    assert all(isinstance(r, EngineError) and "device lost" in str(r) for r in results)
    assert idle_state(engine) == (False, 0.0)
    assert not engine.errored
    assert asyncio.run(final_text(engine, "The quick", "after", max_tokens=5))


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_a_reader_behind_the_engine_loses_no_text(engine, kind) -> None:
    """A reader that reads only once the request has finished gets one output holding all of
    it: the stream replaces a cumulative output it holds by the newer one, and adds a newer
    delta to the one it holds (tokens, text, logprobs of both choices, the prompt's logprobs
    from the first)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1
    )

    async def main() -> list:
        late = copy.copy(params)
        late.output_kind = kind
        stream = await engine.add_request("late", "The quick", late)
        deadline = time.monotonic() + 60
        while engine.submit(lambda e: e.has_unfinished_requests()).result(timeout=30):
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.01)
        # The engine thread handed the last outputs to this loop before it answered; one pass
        # of the loop delivers them (without it, an earlier output already delivered during the
        # sleep above could be read first: the blocking poll holds the loop).
        await asyncio.sleep(0)
        return [out async for out in stream.outputs()]

    async def alone():  # noqa: ANN202
        return [out async for out in engine.generate("The quick", params, "alone")][-1]

    outs = asyncio.run(main())
    want = asyncio.run(alone())
    assert len(outs) == 1 and outs[0].finished
    (got,) = outs
    assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) > 1
    for comp, expected in zip(got.outputs, want.outputs, strict=True):
        assert len(comp.token_ids) == 12 and comp.token_ids == expected.token_ids
        assert comp.text == expected.text and comp.finish_reason == "length"
        assert comp.logprobs == expected.logprobs and len(comp.logprobs) == 12
        assert comp.cumulative_logprob == pytest.approx(expected.cumulative_logprob)

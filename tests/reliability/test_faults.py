"""Faults inside the engine: an exception in a model step fails that step's requests with a clear
error and the engine goes on; a failure that leaves the engine's state unknown marks it dead:
/health answers 503, requests are refused, nothing is served from a broken state."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers.engine import engine_args, patch_execute_model
from helpers.fault_server import POISON, corrupt_and_raise, poisoned
from helpers.generation import GREEDY
from helpers.sse import sse_events

from pagedllm.core.scheduler import SchedulerOutput

BODY = {"prompt": [20, 21, 22, 23], "max_tokens": 12, **GREEDY}
POISONED = {**BODY, "prompt": [POISON, 21, 22, 23]}


def post(server, body: dict) -> httpx.Response:  # noqa: ANN001
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def check_server_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and words in error["message"], error


@pytest.fixture()
def one_at_a_time(serve, tiny_llama):
    """A server running one sequence per step: a request waiting is in no failing step."""
    return serve(engine_args(tiny_llama, max_num_seqs=1))


def test_model_step_exception_fails_only_that_step(one_at_a_time, monkeypatch) -> None:
    server = one_at_a_time
    expected = post(server, BODY).json()["choices"][0]["text"]
    fault = RuntimeError("injected fault in the model")
    patch_execute_model(
        monkeypatch,
        server.engine.engine.executor,
        fault=lambda n, out: fault if poisoned(out) else None,
    )
    results: dict[str, httpx.Response] = {}
    gate, holding = threading.Event(), threading.Event()
    server.engine.submit(lambda e: (holding.set(), gate.wait(30)))  # both adds queue behind it
    assert holding.wait(10)
    try:
        workers = []
        for name, body in (("bad", POISONED), ("good", BODY)):
            workers.append(
                threading.Thread(target=lambda n=name, b=body: results.update({n: post(server, b)}))
            )
            workers[-1].start()
            deadline = time.monotonic() + 30
            while server.engine._commands.qsize() < len(workers):
                assert time.monotonic() < deadline, "the add never reached the engine's queue"
                time.sleep(0.01)  # added in this order: the poisoned one runs first, alone
    finally:
        gate.set()
    for worker in workers:
        worker.join(60)
    check_server_error(results["bad"], 500, "injected fault in the model")
    assert results["good"].json()["choices"][0]["text"] == expected  # it waited: untouched
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**POISONED, "stream": True}, timeout=60
    ) as r:
        events = sse_events(r.read().decode())
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert "injected fault in the model" in events[-2]["error"]["message"]
    server.wait_idle()
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, BODY).json()["choices"][0]["text"] == expected


def test_failure_after_the_model_ran_is_survived(serve) -> None:
    server = serve()
    expected = post(server, BODY).json()["choices"][0]["text"]

    class FailingOnce:
        failed = False

        def record(self, scheduler_stats, iteration_stats) -> None:  # noqa: ANN001
            if not self.failed and scheduler_stats.num_running:
                self.failed = True
                raise RuntimeError("injected fault after the step")

    server.on_engine(lambda e: e.add_stat_logger(FailingOnce()))
    check_server_error(post(server, BODY), 500, "injected fault after the step")
    server.wait_idle()  # the failed requests were aborted; the invariants still hold
    assert not server.engine.errored
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, BODY).json()["choices"][0]["text"] == expected


def corrupt_state(server, monkeypatch) -> None:  # noqa: ANN001
    scheduler = server.engine.engine.scheduler
    update = scheduler.update

    def faulty(out: SchedulerOutput, *args):  # noqa: ANN002, ANN202
        if poisoned(out):
            corrupt_and_raise(scheduler, out)
        return update(out, *args)

    monkeypatch.setattr(scheduler, "update", faulty)


def crash_engine_thread(server, monkeypatch) -> None:  # noqa: ANN001
    engine = server.engine.engine
    real = engine.add_request

    def add(request_id, prompt, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        real(request_id, prompt, *args, **kwargs)
        if prompt["prompt_token_ids"][:1] == [POISON]:
            # breaks the loop itself, outside any step
            monkeypatch.setattr(engine, "has_unfinished_requests", lambda: 1 / 0)

    monkeypatch.setattr(engine, "add_request", add)


@pytest.mark.parametrize("fault", [corrupt_state, crash_engine_thread])
def test_unknown_state_is_reported_unhealthy(serve, monkeypatch, fault) -> None:  # noqa: ANN001
    server = serve()
    deaths: list[BaseException] = []
    server.engine.on_dead = deaths.append
    fault(server, monkeypatch)
    assert post(server, BODY).status_code == 200
    r = post(server, POISONED)
    assert r.status_code >= 500 and r.json()["error"]["type"] == "server_error"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "engine is dead" in health.json()["error"]["message"]
    assert len(deaths) == 1 and server.engine.errored
    r = post(server, BODY)  # refused, not served from a broken state
    check_server_error(r, 503, "dead")
    assert r.json()["error"]["code"] == "engine_dead"

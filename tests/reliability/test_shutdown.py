"""``pagedllm serve`` as a process: SIGTERM drains the requests in flight and exits 0; a fault
that leaves the engine's state unknown makes the server exit 1 instead of serving on. Neither
writes prompt text to its log at the default level."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.engine import MODEL
from helpers.fault_server import POISON
from helpers.generation import GREEDY
from helpers.process import Output
from helpers.sse import sse_events

SECRET = "zebra-secret-prompt-7781"  # must never reach the log
HELPERS = Path(__file__).parents[1] / "helpers"
URL = r"URL\s+(http://\S+)/v1"  # the startup block's line with the server's address
OUTPUTS: dict[int, Output] = {}  # the output of each server this module started, by pid


def start_server(model: Path, step_delay: float) -> tuple[subprocess.Popen, str]:
    """The serve command with faults installed, at default log levels; (process, base URL)."""
    cmd = [
        sys.executable,
        str(HELPERS / "fault_server.py"),
        str(step_delay),
        "serve",
        str(model),
        "--port=0",
        f"--served-model-name={MODEL}",
        "--max-model-len=256",
        "--kv-cache-memory-bytes=4194304",
        "--graceful-shutdown-timeout=20",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PAGEDLLM_LOG_LEVEL", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    OUTPUTS[proc.pid] = output = Output(proc)
    line = output.until(lambda line: re.search(URL, line) is not None, timeout=120)
    url = re.search(URL, line).group(1)
    deadline = time.monotonic() + 60  # uvicorn may lag the banner
    while not healthy(url):
        assert time.monotonic() < deadline and proc.poll() is None, "never healthy"
        time.sleep(0.05)
    return proc, url


def requests_in_engine(url: str) -> float:
    """Running plus waiting requests, as the server's /metrics reports them."""
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, OUTPUTS.pop(proc.pid).rest()


@pytest.fixture()
def cleanup():
    procs: list[subprocess.Popen] = []
    yield procs.append
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_llama, cleanup) -> None:
    proc, url = start_server(tiny_llama, step_delay=0.02)  # 80 tokens take >= 1.6 s
    cleanup(proc)
    body = {"prompt": f"{SECRET} tell me", "max_tokens": 80, **GREEDY}
    bad = httpx.post(url + "/v1/completions", json={**body, "temperature": -1})
    assert bad.status_code == 400  # a refused prompt is not logged either
    results: dict[str, object] = {}
    started = threading.Semaphore(0)

    def streamed(key: str) -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            raw = ""
            for chunk in r.iter_text():
                if not raw:
                    started.release()  # the first event: generating
                raw += chunk
        results[key] = sse_events(raw)

    def plain(key: str) -> None:
        results[key] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    workers = [threading.Thread(target=streamed, args=(f"s{i}",)) for i in range(3)]
    workers += [threading.Thread(target=plain, args=(f"p{i}",)) for i in range(2)]
    for w in workers:
        w.start()
    for _ in range(3):
        assert started.acquire(timeout=60)
    # the two plain requests in the engine too (on a busy machine their connections can come
    # after the streams' first events): an ordering, however long it takes
    deadline = time.monotonic() + 60
    while requests_in_engine(url) < 5:
        assert time.monotonic() < deadline, "the plain requests never reached the engine"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    # New connections are refused while the others drain: an ordering of two events (the
    # refusal came while a request was still running), however long each takes.
    deadline = time.monotonic() + 120  # ends a hang only
    while True:
        draining = any(w.is_alive() for w in workers)
        try:
            httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:
            break
        assert draining, "the drain ended before new connections were refused"
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.05)
    assert draining  # the drain had work left to do when the refusal came
    for w in workers:
        w.join(timeout=60)
    code, log = finish(proc, timeout=30)
    assert code == 0, log
    for i in range(3):
        events = results[f"s{i}"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in events[:-1])
    for i in range(2):
        assert results[f"p{i}"]["usage"]["completion_tokens"] == 80
    assert "Traceback" not in log and SECRET not in log, log


def test_unknown_engine_state_exits_1(tiny_llama, cleanup) -> None:
    proc, url = start_server(tiny_llama, step_delay=0.0)
    cleanup(proc)
    ok = httpx.post(url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 4})
    assert ok.status_code == 200
    poisoned = {"prompt": [POISON, 40, 41], "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=poisoned, timeout=60)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    code, log = finish(proc, timeout=30)
    assert code == 1, log
    assert "the engine died" in log and SECRET not in log, log

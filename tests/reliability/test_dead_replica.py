"""A replica whose engine died says so: with ``--tensor-parallel-size 2`` and rank 1's worker
killed (SIGKILL), the request in flight fails with a clear 500 naming the rank, /health
answers 503 from then on, every new request gets a 503 ``engine_dead`` body, and
``pagedllm serve`` exits with status 1 so that a supervisor (Kubernetes, a router's health
check) replaces the replica instead of sending it traffic."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

MODEL = "tiny"
LONG = {"prompt": "a b c", "max_tokens": 230, "ignore_eos": True, "stream": True}


def stream_until_error(url: str, started: threading.Event, result: dict[str, Any]) -> None:
    """A streaming completion; sets started at its first chunk, stores its events."""
    events: list[Any] = []
    with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=120) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                body = line.removeprefix("data: ")
                events.append(body if body == "[DONE]" else json.loads(body))
                started.set()
    result["events"] = events
    started.set()


def kill_mid_stream(url: str, pid: int) -> dict[str, Any]:
    """Start a long stream, SIGKILL pid once its first token is out, return what it got."""
    started, result = threading.Event(), {}
    client = threading.Thread(target=stream_until_error, args=(url, started, result))
    client.start()
    assert started.wait(120), "the stream never started"
    os.kill(pid, signal.SIGKILL)
    client.join(120)
    assert not client.is_alive()
    return result


def assert_failed_for_rank_1(result: dict[str, Any]) -> None:
    assert result["status"] == 200  # the stream had started; its end carries the error
    errors = [e["error"] for e in result["events"] if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, result["events"][-3:]
    assert "rank 1" in errors[0]["message"] and "killed by signal 9" in errors[0]["message"]
    texts = [e for e in result["events"] if isinstance(e, dict) and "choices" in e]
    assert 0 < len(texts) < LONG["max_tokens"]  # killed mid-run, not after it


@pytest.fixture()
def tp_server(tiny_llama):
    args = EngineArgs(
        model=str(tiny_llama),
        tensor_parallel_size=2,
        kv_cache_memory_bytes=1 << 22,
        max_model_len=256,
    )
    app = build_app(args, [MODEL], log_stats_interval=None)
    with serve_in_thread(app) as url:
        yield url, app


def test_dead_engine_answers_503_to_health_and_new_requests(tp_server) -> None:
    url, app = tp_server
    assert httpx.get(url + "/health").status_code == 200
    pid = app.state.engine.engine.executor.worker_pids[1]
    assert_failed_for_rank_1(kill_mid_stream(url, pid))
    health = httpx.get(url + "/health")  # at once: the engine was marked dead before the error
    assert health.status_code == 503
    assert "rank 1" in health.json()["error"]["message"]
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_dead" and "rank 1" in error["message"], error


def start_serve(model: Path) -> tuple[subprocess.Popen, str, int]:
    """``pagedllm serve --tensor-parallel-size 2``; (process, base URL, rank 1's pid)."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model), "--port=0"]
    cmd += [f"--served-model-name={MODEL}", "--max-model-len=256", "--tensor-parallel-size=2"]
    cmd += ["--kv-cache-memory-bytes=4194304"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEDLLM_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    pid = url = None
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the server exited during startup:\n" + "".join(lines)
        lines.append(line)
        if m := re.search(r"rank 1 pid (\d+)", line):
            pid = int(m.group(1))
        if m := re.search(r"URL\s+(http://\S+)/v1", line):
            url = m.group(1)
    assert url is not None and pid is not None, "".join(lines)
    while httpx.get(url + "/health", timeout=5).status_code != 200:  # uvicorn may lag the banner
        time.sleep(0.05)
    return proc, url, pid


def test_serve_exits_1_when_a_tensor_parallel_worker_dies(tiny_llama) -> None:
    proc, url, pid = start_serve(tiny_llama)
    try:
        assert_failed_for_rank_1(kill_mid_stream(url, pid))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    assert proc.returncode == 1, log[-3000:]
    assert "the engine died" in log and "rank 1" in log, log[-3000:]

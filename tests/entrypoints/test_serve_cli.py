"""``pagedllm serve`` as a user runs it: a subprocess on a free port, its startup block, a
request through the openai client, and a clean stop on Ctrl-C."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from helpers.process import Output, read_banner, server_url, stop_cleanly, wait_healthy


def test_serve_command_prints_banner_serves_and_stops(tiny_llama) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        str(tiny_llama),
        "--port=0",
        "--served-model-name=tiny",
        "--max-model-len=256",
        "--kv-cache-memory-bytes=4194304",
        "--uvicorn-log-level=warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    output = Output(proc)
    try:
        banner = read_banner(output, "metrics", timeout=120)
        url = server_url(banner)
        assert re.search(r"model\s+tiny", banner)
        assert re.search(r"dtype\s+float32", banner) and re.search(r"device\s+cpu", banner)
        blocks = int(re.search(r"KV cache\s+(\d+) blocks x 16 tokens = (\d+) tokens", banner)[1])
        assert blocks > 0
        # 256-token requests need 16 blocks each.
        assert f"concurrency  {blocks / 16:.2f}x  (requests of max_model_len 256 " in banner
        assert f"metrics      {url}/metrics" in banner
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        result = client.completions.create(model="tiny", prompt="The quick", max_tokens=5)
        assert result.usage.completion_tokens == 5
    finally:
        stop_cleanly(proc, output)


def test_nothing_listens_until_the_engine_is_ready(tiny_llama, monkeypatch) -> None:
    """While the model loads, the port is taken but refuses connections (a probe fails at
    once instead of hanging); once the engine is ready /health answers 200."""
    from pagedllm import EngineArgs
    from pagedllm.entrypoints.openai import server as server_module

    real_build = server_module.build_app
    loading, release = threading.Event(), threading.Event()
    apps = []

    def slow_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        loading.set()
        assert release.wait(60)
        apps.append(real_build(*args, **kwargs))
        return apps[-1]

    monkeypatch.setattr(server_module, "build_app", slow_build)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=128)
    status: list[int] = []
    thread = threading.Thread(
        target=lambda: status.append(
            server_module.run_server(
                args, port=port, uvicorn_log_level="warning", log_stats_interval=None
            )
        )
    )
    thread.start()
    try:
        assert loading.wait(60)
        url = f"http://127.0.0.1:{port}"
        # refused (ConnectError), not left waiting: a connection that hangs until the
        # timeout raises ConnectTimeout, which is no ConnectError
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # yet the port is held for the server
    finally:
        release.set()
    deadline = time.monotonic() + 60
    r = None
    while r is None:
        try:
            r = httpx.get(url + "/health", timeout=5)
        except httpx.ConnectError:
            assert time.monotonic() < deadline, "the server never listened once ready"
            time.sleep(0.05)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    apps[0].state.engine.on_dead(RuntimeError("test over"))  # stops the server
    thread.join(timeout=60)
    assert status == [1]


def test_the_server_process_freezes_its_startup_heap_and_threads_do_not():
    """run_server's process moves start-up's objects out of the collector's generations
    (gc.freeze); a server run on another thread (as in these tests) leaves them collectable."""
    import gc

    from pagedllm.entrypoints.openai.server import _freeze_startup_heap

    assert gc.get_freeze_count() == 0
    thread = threading.Thread(target=_freeze_startup_heap)
    thread.start()
    thread.join()
    assert gc.get_freeze_count() == 0
    try:
        _freeze_startup_heap()  # pytest runs tests on the main thread
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

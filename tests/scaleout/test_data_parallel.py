"""`pagedllm serve MODEL --data-parallel-size 2`: two replicas behind vllm-router (kv_aware)
as one command: requests through its URL are answered, requests sharing a prefix go to one
replica, SIGTERM stops the group with 0, and a dead replica makes it exit 1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from helpers.replicas import DEMO, binary, wait_until

from pagedllm.entrypoints.data_parallel import replica_argv

SHARED = "In the laboratory the engineers calibrated each sensor twice before the test run " * 4


def start_group() -> tuple[subprocess.Popen, str, list[str]]:
    binary("vllm-router")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(DEMO), "--port=0"]
    cmd += ["--data-parallel-size=2", "--served-model-name=demo", "--disable-log-stats"]
    cmd += ["--kv-cache-memory-bytes=8388608"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the group exited during startup:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("pagedllm data-parallel server"):
            break
    block = [proc.stdout.readline() for _ in range(4)]
    url = re.search(r"URL\s+(http://\S+)/v1", block[0])[1]
    replicas = [re.search(r"(http://\S+)", ln)[1] for ln in block[2:4]]
    assert "vllm-router --policy kv_aware" in block[1]
    import threading

    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe flowing
    return proc, url, replicas


def requests_of(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(v) for v in re.findall(r"^vllm:request_success_total\{.*\} (\S+)$", text, re.M)
    )


def test_group_serves_routes_by_prefix_and_stops_cleanly() -> None:
    proc, url, replicas = start_group()
    try:
        body = {"model": "demo", "max_tokens": 2, "temperature": 0}
        for i in range(4):
            r = httpx.post(
                url + "/v1/completions", json={**body, "prompt": SHARED + str(i)}, timeout=120
            )
            assert r.status_code == 200, r.text
        counts = sorted(requests_of(u) for u in replicas)
        assert counts == [0.0, 4.0]  # the shared prefix kept them on one replica
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        for u in replicas:
            with pytest.raises(httpx.TransportError):
                httpx.get(u + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_dead_replica_ends_the_group_with_1() -> None:
    proc, url, replicas = start_group()
    try:
        port = int(replicas[1].rsplit(":", 1)[1])
        pid = next(
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and f"--port={port}".encode() in _cmdline(p)
        )
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(90) == 1
        wait_until(lambda: _gone(replicas[0]), 60, "the other replica stopped")
    finally:
        if proc.poll() is None:
            proc.kill()


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _gone(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_replica_arguments_drop_the_groups_own_flags() -> None:
    argv = [
        "m",
        "--port",
        "8000",
        "--host=0.0.0.0",
        "--data-parallel-size",
        "2",
        "--max-num-seqs=4",
    ]
    argv += ["--kv-events-config", "{}", "--data-parallel-router=sglang-router", "--seed", "3"]
    assert replica_argv(argv) == ["m", "--max-num-seqs=4", "--seed", "3"]

"""``pagedllm serve`` as a user runs it, in a subprocess on a free port: the URL it prints,
once /health answers, and a Ctrl-C stop that must exit cleanly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def _read_banner(proc: subprocess.Popen, timeout: float) -> str:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("server exited early:\n" + "".join(lines))
        lines.append(line)
        if "metrics" in line and "URL" in "".join(lines):
            return "".join(lines)
    raise AssertionError("no startup block:\n" + "".join(lines))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


@contextlib.contextmanager
def pagedllm_serve(*args: str, timeout: float = 180) -> Iterator[str]:
    """Run ``pagedllm serve ARGS --port=0``; yields the base URL (no /v1)."""
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        *args,
        "--port=0",
        "--uvicorn-log-level=warning",
        "--disable-log-stats",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        banner = _read_banner(proc, timeout)
        url = re.search(r"URL\s+(http://\S+)/v1", banner).group(1)
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    rest = proc.stdout.read()
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest, rest

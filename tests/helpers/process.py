"""A child process's output read on a thread of its own: a wait for a line then has a real
deadline (readline() on a process that prints nothing would block past any deadline), and a
chatty process never blocks on a full pipe."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx


class Output:
    """Every line of proc's stdout (text mode, stderr merged or not), as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE"
        self.proc = proc
        self.lines: list[str] = []  # every line read so far
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._forward, daemon=True).start()

    def _forward(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)  # the end of the output: the process closed it

    def until(self, found: Callable[[str], bool], timeout: float) -> str:
        """The first line for which found() is true; AssertionError with the output so far
        when the output ends or timeout seconds pass first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError("the process ended its output:\n" + "".join(self.lines))
            self.lines.append(line)
            if found(line):
                return line
        raise AssertionError(f"nothing of the kind in {timeout:.0f} s:\n" + "".join(self.lines))

    def rest(self, timeout: float = 30.0) -> str:
        """What the process printed after the last line taken, up to its end (call it once
        the process has exited)."""
        start = len(self.lines)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines[start:])


SERVER_URL = r"URL\s+(http://\S+)/v1"  # the serve command's startup block: its address


def read_banner(output: Output, marker: str, timeout: float) -> str:
    """The serve command's output up to the first line containing marker after its URL."""
    output.until(lambda line: re.search(SERVER_URL, line) is not None, timeout)
    output.until(lambda line: marker in line, timeout)
    return "".join(output.lines)


def server_url(banner: str) -> str:
    match = re.search(SERVER_URL, banner)
    assert match is not None, banner
    return match.group(1)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Poll /health until it answers 200; AssertionError if the server exits or never does."""
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


def stop_cleanly(proc: subprocess.Popen, output: Output) -> None:
    """Ctrl-C the server as a user would; it must exit 0 within 30 s with no traceback."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    rest = output.rest()
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest, rest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pagedllm ARGS...` in a child Python (this interpreter), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )

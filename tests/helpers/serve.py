"""``pagedllm serve`` as a user runs it, in a subprocess on a free port: the URL it prints,
once /health answers, and a Ctrl-C stop that must exit cleanly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from helpers.process import Output, read_banner, server_url, stop_cleanly, wait_healthy


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
    output = Output(proc)
    try:
        url = server_url(read_banner(output, "metrics", timeout))
        wait_healthy(url, proc)
        yield url
    finally:
        stop_cleanly(proc, output)

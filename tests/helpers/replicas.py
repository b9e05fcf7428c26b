"""`pagedllm serve` replicas and the routers in front of them, started for real on loopback.

Each replica of the demo model publishes its KV-cache events on a PUB port of its own; the
routers (vllm-router, sglang-router: PyPI packages with Rust binaries) get the replicas'
URLs, and vllm-router's kv_aware policy their event endpoints. Nothing leaves the machine:
vllm-router tokenizes with the demo model's own tokenizer.json (VLLM_ROUTER_TOKENIZER).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "pagedllm-demo"
MODEL = "demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    """The router's executable; skipped when missing, except under CI=true."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is missing (pip install 'pagedllm[dev]')"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout} s")


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str
    events: str  # the PUB endpoint a subscriber connects to
    replay: str

    def metric(self, name: str) -> float:
        """The sum of a vllm: series over its labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        pattern = rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    @property
    def requests(self) -> float:
        return self.metric("request_success_total")

    @property
    def prefix_hits(self) -> float:
        return self.metric("prefix_cache_hits_total")

    def complete(self, prompt: str, max_tokens: int = 2, **fields: object) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body.update(fields)
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def start_replica(extra: tuple[str, ...] = ()) -> Replica:
    ev, replay = free_port(), free_port()
    events = (
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{ev}", '
        f'"replay_endpoint": "tcp://*:{replay}"}}'
    )
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(DEMO), "--port=0"]
    cmd += [f"--served-model-name={MODEL}", "--kv-cache-memory-bytes=8388608"]
    cmd += [f"--kv-events-config={events}", "--disable-log-stats", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the replica exited during startup:\n" + "".join(lines)
        lines.append(line)
        if m := re.search(r"URL\s+(http://\S+)/v1", line):
            url = m.group(1)
            break
    else:
        raise AssertionError("no startup block:\n" + "".join(lines))
    _drain(proc)
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, 30, "replica health")
    return Replica(proc, url, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{replay}")


def _drain(proc: subprocess.Popen) -> None:
    """Read the replica's log in the background so that a full pipe never blocks it."""
    import threading

    threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    log: Path
    replicas: list[Replica] = field(default_factory=list)

    def complete(self, prompt: str, max_tokens: int = 2, **fields: object) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body.update(fields)
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)

    def route(self, prompt: str) -> int:
        """Send one completion; the index of the replica that answered it."""
        before = [r.requests for r in self.replicas]
        response = self.complete(prompt)
        assert response.status_code == 200, response.text
        after = [r.requests for r in self.replicas]
        (index,) = [i for i in range(len(after)) if after[i] > before[i]]
        return index


def start_router(kind: str, policy: str, replicas: list[Replica], log_dir: Path) -> Router:
    """vllm-router or sglang-router on a free port, in front of the replicas."""
    port = free_port()
    urls = [r.url for r in replicas]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    common += ["--policy", policy, "--prometheus-port", str(free_port())]
    env = {**os.environ}
    if kind == "vllm":
        cmd = [binary("vllm-router"), *common]
        if policy == "kv_aware":
            for r in replicas:
                cmd += ["--kv-event-source", f"{r.url}={r.events}"]
                cmd += ["--kv-event-replay-source", f"{r.url}={r.replay}"]
            cmd += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        env["VLLM_ROUTER_TOKENIZER"] = str(DEMO)  # its tokenizer.json: no hub download
    else:
        binary("sglang-router")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *common]
    log = log_dir / f"{kind}-{policy}-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, f"the router exited:\n{log.read_text()[-3000:]}"
        return httpx.get(url + "/health", timeout=5).status_code == 200

    wait_until(ready, 60, "router health")
    return Router(proc, url, log, list(replicas))

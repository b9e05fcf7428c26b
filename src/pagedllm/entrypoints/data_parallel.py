"""``pagedllm serve MODEL --data-parallel-size N``: N replicas behind an existing router.

vLLM's flag, built on what a deployment would run by hand: N ``pagedllm serve`` processes on
loopback ports, each publishing its KV-cache events, and vllm-router (kv_aware, following
those events) or sglang-router (cache_aware) on ``--host``/``--port`` in front of them. The
threads are split between the replicas (``OMP_NUM_THREADS`` each: the cores / N unless set).
If the router or a replica exits, the others are stopped and the command exits 1, so that a
supervisor restarts the whole group; SIGTERM / Ctrl-C stop the router, then drain the
replicas, and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

ROUTERS = ("vllm-router", "sglang-router")
# flags of the group's command that the replicas do not get (they are set per replica)
_OWN_FLAGS = (
    "--host",
    "--port",
    "--data-parallel-size",
    "--data-parallel-router",
    "--kv-events-config",
)


def add_data_parallel_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="replicas of the model, each a server of its own, behind a router on --port",
    )
    group.add_argument(
        "--data-parallel-router",
        choices=ROUTERS,
        default="vllm-router",
        help="with --data-parallel-size: vllm-router (kv_aware, reads the replicas' KV-cache "
        "events) or sglang-router (cache_aware); pip install it",
    )


def replica_argv(argv: list[str]) -> list[str]:
    """The serve arguments of one replica: the group's, without its own flags."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Replica:
    def __init__(self, argv: list[str], threads: int) -> None:
        self.port, self.events_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.events_port}"}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *argv]
        cmd += [
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--kv-events-config={json.dumps(events)}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(cmd, env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode} at start")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


def _router_command(
    kind: str, host: str, port: int, replicas: list[_Replica], model: str, block_size: int
) -> list[str]:
    exe = shutil.which(kind)
    if exe is None:
        raise ValueError(f"--data-parallel-size needs {kind}: pip install {kind}")
    urls = [r.url for r in replicas]
    cmd = [exe, "--host", host, "--port", str(port), "--worker-urls", *urls]
    cmd += ["--prometheus-port", str(_free_port())]
    if kind == "sglang-router":
        return [*cmd, "--policy", "cache_aware"]
    cmd += ["--policy", "kv_aware", "--kv-event-model", model]
    cmd += ["--kv-event-block-size", str(block_size)]  # the replicas' blocks
    for r in replicas:
        cmd += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{r.events_port}"]
    return cmd


def _tokenizer_env(ns: argparse.Namespace) -> dict[str, str]:
    """vllm-router tokenizes prompts: the model's own tokenizer.json, so it fetches nothing."""
    folder = Path(ns.tokenizer or ns.model_pos or ns.model or "")
    if (folder / "tokenizer.json").exists():
        return {"VLLM_ROUTER_TOKENIZER": str(folder.resolve())}
    logger.warning("no tokenizer.json in %s: vllm-router looks the model up on the hub", folder)
    return {}


def run_data_parallel(ns: argparse.Namespace, argv: list[str]) -> int:
    """Start the replicas and the router, print where to connect, supervise them."""
    n = ns.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be positive, got {n}.")
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or n) // n))
    replicas = [_Replica(replica_argv(argv), threads) for _ in range(n)]
    router: subprocess.Popen | None = None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for r in replicas:
            wait_healthy(r.url, r.proc, 900)
        port = ns.port or _free_port()
        model = (ns.served_model_name or [str(ns.model_pos or ns.model)])[0]
        kind = ns.data_parallel_router
        cmd = _router_command(kind, ns.host, port, replicas, model, ns.block_size)
        env = {**os.environ, **_tokenizer_env(ns)}
        router = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        shown = f"[{ns.host}]" if ":" in ns.host else ns.host
        local = "127.0.0.1" if ns.host in ("0.0.0.0", "::") else shown
        wait_healthy(f"http://{local}:{port}", router, 120)
        _print_banner(f"http://{shown}:{port}", ns.data_parallel_router, replicas, threads)
        return _supervise(router, replicas)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(router, replicas)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _print_banner(url: str, kind: str, replicas: list[_Replica], threads: int) -> None:
    policy = "kv_aware" if kind == "vllm-router" else "cache_aware"
    lines = [
        "pagedllm data-parallel server",
        f"  URL          {url}/v1   (completions, chat/completions, models)",
        f"  router       {kind} --policy {policy}",
    ]
    lines += [f"  replica {i}    {r.url} ({threads} threads)" for i, r in enumerate(replicas)]
    width = max(len(line) for line in lines)
    print("\n".join(["=" * width, *lines, "=" * width]), flush=True)


def _supervise(router: subprocess.Popen, replicas: list[_Replica]) -> int:
    while True:
        if router.poll() is not None:
            logger.critical("the router exited with %s; stopping the replicas", router.returncode)
            return 1
        for i, r in enumerate(replicas):
            if r.proc.poll() is not None:
                logger.critical("replica %d exited with %s; stopping", i, r.proc.returncode)
                return 1
        time.sleep(0.5)


def _stop(router: subprocess.Popen | None, replicas: list[_Replica]) -> None:
    """The router first (no new requests), then the replicas drain what they hold."""
    procs = ([router] if router is not None else []) + [r.proc for r in replicas]
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

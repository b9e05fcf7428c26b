"""Edge/cloud split helpers: plans for fixed cuts and cloud workers in subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.ci import unavailable as ci_unavailable
from helpers.process import Output
from pagedllm.config import EngineArgs
from pagedllm.partition import DeviceProfile, GraphPartitioner, LinkProfile, netem
from pagedllm.partition.graph import graph_for_model
from pagedllm.partition.netem import DelayProxy, EmulatedNetwork
from pagedllm.partition.runtime import CloudWorker

CPU = DeviceProfile("cpu", {"float32": 5e10}, 1e10, 8 << 30)


def make_plan(
    model_dir: Path, cut: int | list[int], path: Path, wire_dtype: str = "float32"
) -> Path:
    """A plan JSON for fixed cut(s) (the runtime only reads the cuts and the wire dtype)."""
    cuts = [cut] if isinstance(cut, int) else list(cut)
    graph = graph_for_model(str(model_dir), "float32")
    partitioner = GraphPartitioner(wire_dtype=wire_dtype)
    devices = [CPU] * (len(cuts) + 1)
    partitioner.analyze(graph, devices, LinkProfile(1000, 1), cuts=cuts).save(path)
    return path


@dataclass
class Worker:
    address: str
    process: subprocess.Popen

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def launch_worker(
    model_dir: Path,
    plan: Path,
    *extra: str,
    address: str = "127.0.0.1:0",
    via_serve: bool = False,
    prefix: tuple[str, ...] = (),
):
    """Start a cloud worker process (split-worker, or serve --role cloud); ready() waits for
    its address."""
    command = ["serve", "--role", "cloud"] if via_serve else ["split-worker", "--threads", "1"]
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        *command,
        str(model_dir),
        "--partition",
        str(plan),
        "--partition-address",
        address,
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--kv-cache-memory-bytes",
        str(1 << 20),
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ready(proc: subprocess.Popen, timeout: float = 120.0) -> Worker:
    """The worker once it prints its address; RuntimeError with its output if it exits or
    says nothing of the kind within timeout seconds (a silent worker does not hang here)."""
    try:
        line = Output(proc).until(lambda line: "listening on" in line, timeout)
    except AssertionError as e:
        proc.kill()
        raise RuntimeError(f"cloud worker did not start: {e}") from None
    return Worker(line.rsplit(" ", 1)[1].strip(), proc)


@contextlib.contextmanager
def inprocess_cloud(
    model_dir: Path,
    plan: Path,
    address: str = "127.0.0.1:0",
    role: str = "cloud",
    next_address: str | None = None,
):
    """A worker served from this process (same gRPC path, no process start-up): the cloud,
    or with role "tierN" and next_address a tier in between."""
    args = EngineArgs(
        model=str(model_dir),
        partition_config={"plan": str(plan), "role": role, "address": address},
        dtype="float32",
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
    )
    cloud = CloudWorker(args.create_engine_config(), next_address)
    server = cloud.serve()
    try:
        yield cloud, server
    finally:
        server.stop()


@dataclass
class Link:
    """A cloud worker behind an emulated link: the edge connects to ``address`` (the
    delaying proxy on loopback), which reaches the worker over the namespaces' veth."""

    address: str
    proxy: DelayProxy
    network: EmulatedNetwork
    worker: Worker


@contextlib.contextmanager
def emulated_network(rate_mbit: float = 1000.0):
    """Two namespaces joined by a shaped veth pair, deleted afterwards whatever happens.
    Skips (fails under CI=true) where namespaces cannot be made."""
    reason = netem.unavailable()
    if reason is not None:
        ci_unavailable(f"emulated network: {reason}")
    with EmulatedNetwork(rate_mbit) as net:
        yield net


@contextlib.contextmanager
def worker_behind(net: EmulatedNetwork, model_dir: Path, plan: Path, *extra: str, rtt_ms=0.0):
    """A cloud worker in the network's cloud namespace behind its own delaying proxy."""
    proc = launch_worker(
        model_dir, plan, *extra, address=f"{net.cloud_ip}:0", prefix=tuple(net.exec_prefix())
    )
    try:
        worker = ready(proc)
        with DelayProxy(worker.address, net.edge_ns, rtt_ms=rtt_ms) as proxy:
            yield Link(proxy.address, proxy, net, worker)
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def emulated_link(
    model_dir: Path, plan: Path, *extra: str, rate_mbit: float = 1000.0, rtt_ms: float = 0.0
):
    """One cloud worker across an emulated network of its own."""
    with emulated_network(rate_mbit) as net:
        with worker_behind(net, model_dir, plan, *extra, rtt_ms=rtt_ms) as link:
            yield link

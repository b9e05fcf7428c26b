"""An emulated network between tiers on one machine: two network namespaces joined by a
veth pair, the rate shaped by ``tc ... tbf``, and delay, jitter and loss added by a small
delaying TCP proxy.

    edge process --loopback--> DelayProxy --veth (tbf both ways)--> cloud worker
    (root namespace)           listens on 127.0.0.1,                in namespace <name>-b,
                               connects from namespace <name>-a     started with exec_prefix()

The proxy runs in a process of its own (so the edge's Python never delays its timers) and
takes commands on a control socket while it runs: a new delay, jitter or loss rate, or
``down`` (the link is lost: every byte is dropped, connections open at that moment never
carry data again) and ``up``. Where ``tc netem`` exists the delay could be put on the veth
itself; these kernels lack it, and the proxy works everywhere the namespaces do.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why not. Traffic stays on
loopback and inside the namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

CHUNK = 1 << 16


class NetemError(RuntimeError):
    """The emulated network could not be set up."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian package iproute2)"
    probe = f"pl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetemError(f"{' '.join(cmd)}: {done.stderr.strip()}")


class EmulatedNetwork:
    """Namespaces ``<name>-a`` (the edge's side) and ``<name>-b`` (the cloud's) joined by a
    veth pair, 10.<n>.0.1 <-> 10.<n>.0.2, each end's egress shaped to ``rate_mbit``."""

    def __init__(self, rate_mbit: float = 1000.0, name: str | None = None) -> None:
        self.name = name or f"pl{uuid.uuid4().hex[:6]}"
        self.edge_ns, self.cloud_ns = f"{self.name}-a", f"{self.name}-b"
        octet = 16 + int(uuid.uuid4().hex[:4], 16) % 200
        self.edge_ip, self.cloud_ip = f"10.{octet}.0.1", f"10.{octet}.0.2"
        self.rate_mbit = rate_mbit
        self._made: list[str] = []

    def __enter__(self) -> EmulatedNetwork:
        self.create()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def create(self) -> None:
        try:
            for ns in (self.edge_ns, self.cloud_ns):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            va, vb = f"{self.name}a", f"{self.name}b"
            _run("ip", "link", "add", va, "netns", self.edge_ns, "type", "veth", "peer",
                 "name", vb, "netns", self.cloud_ns)  # fmt: skip
            for ns, dev, ip in (
                (self.edge_ns, va, self.edge_ip),
                (self.cloud_ns, vb, self.cloud_ip),
            ):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            self.set_rate(self.rate_mbit)
        except Exception:
            self.close()
            raise

    def _devices(self) -> tuple[tuple[str, str], tuple[str, str]]:
        return (self.edge_ns, f"{self.name}a"), (self.cloud_ns, f"{self.name}b")

    def set_rate(self, rate_mbit: float) -> None:
        """Shape both directions to rate_mbit with a token bucket (tbf)."""
        # The bucket holds a few ms of traffic (at least 32 KiB) and queues up to 100 ms.
        burst = max(32 << 10, int(rate_mbit * 1e6 / 8 * 0.004))
        for ns, dev in self._devices():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")  # fmt: skip
        self.rate_mbit = rate_mbit

    def exec_prefix(self, side: str = "cloud") -> list[str]:
        """The command prefix that runs a program in one side's namespace."""
        return ["ip", "netns", "exec", self.cloud_ns if side == "cloud" else self.edge_ns]

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth end too
            for _ in range(20):
                done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
                if done.returncode == 0 or not os.path.exists(f"/var/run/netns/{ns}"):
                    break
                time.sleep(0.1)  # a process that was in it may still be exiting
            else:
                raise NetemError(f"cannot delete namespace {ns}: {done.stderr.strip()}")
        self._made.clear()


@dataclass
class Shape:
    """What the proxy adds to every chunk of bytes, each direction."""

    rtt_ms: float = 0.0  # half of it each way
    jitter_ms: float = 0.0  # uniform in [0, jitter) on top, order kept
    loss: float = 0.0  # chance a chunk is "lost": delivered one retransmission timeout late
    down: bool = False  # the link is lost: nothing passes

    def one_way_s(self, rng: random.Random) -> float:
        delay = self.rtt_ms / 2e3 + rng.random() * self.jitter_ms / 1e3
        if self.loss and rng.random() < self.loss:
            delay += max(0.2, 2 * self.rtt_ms / 1e3)  # TCP's minimum RTO
        return delay


class _Proxy:
    def __init__(self, upstream: tuple[str, int], netns: str | None, shape: Shape) -> None:
        self.upstream, self.netns, self.shape = upstream, netns, shape
        self.rng = random.Random(0)
        self.epoch = 0  # bumped when the link goes down: older connections are dead
        self.writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        epoch = self.epoch
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.upstream)
            up_reader, up_writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            writer.close()
            return
        for w in (writer, up_writer):
            w.transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
            self.writers.add(w)
        await asyncio.gather(
            self._pump(reader, up_writer, epoch), self._pump(up_reader, writer, epoch)
        )
        for w in (writer, up_writer):
            self.writers.discard(w)
            w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, epoch: int
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer, epoch))
        last = 0.0
        try:
            while data := await reader.read(CHUNK):
                if self.shape.down or epoch != self.epoch:
                    continue  # dropped on the floor
                last = max(last, time.monotonic() + self.shape.one_way_s(self.rng))
                queue.put_nowait((last, data))
        except OSError:
            pass
        queue.put_nowait((0.0, b""))
        await sender

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, epoch: int
    ) -> None:
        while True:
            at, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if self.shape.down or epoch != self.epoch:
                continue
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                break
        with contextlib.suppress(OSError):
            writer.write_eof()

    def control(self, line: str) -> str:
        """``set rtt_ms=20 jitter_ms=1 loss=0.01`` | ``down`` | ``up`` | ``show``."""
        words = line.split()
        if not words:
            return "ok"
        if words[0] == "down":
            self.shape.down = True
            self.epoch += 1
        elif words[0] == "up":
            self.shape.down = False
            for w in list(self.writers):  # connections cut by the outage stay cut
                w.transport.abort()
        elif words[0] == "set":
            for item in words[1:]:
                key, value = item.split("=", 1)
                setattr(self.shape, key, float(value))
        return f"ok {self.shape}"

    async def serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        while line := await reader.readline():
            try:
                reply = self.control(line.decode())
            except (ValueError, AttributeError) as e:
                reply = f"error {e}"
            writer.write((reply + "\n").encode())
            await writer.drain()
        writer.close()


def _enter_netns(name: str) -> None:
    """setns(2) for this (single-threaded) process: os.setns is Python 3.12+ only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


async def _main(ns: argparse.Namespace) -> None:
    host, port = ns.upstream.rsplit(":", 1)
    proxy = _Proxy((host, int(port)), ns.netns, Shape(ns.rtt_ms, ns.jitter_ms, ns.loss))
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", ns.port)
    control = await asyncio.start_server(proxy.serve_control, "127.0.0.1", 0)
    if ns.netns:  # the listeners stay on this loopback; sockets made from now on are there
        _enter_netns(ns.netns)
    addr = server.sockets[0].getsockname()
    ctl = control.sockets[0].getsockname()
    print(f"proxy on 127.0.0.1:{addr[1]} control 127.0.0.1:{ctl[1]}", flush=True)
    await asyncio.gather(server.serve_forever(), control.serve_forever())


class DelayProxy:
    """The delaying proxy in a child process: ``address`` is where the edge connects."""

    def __init__(
        self,
        upstream: str,
        netns: str | None = None,
        rtt_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
    ) -> None:
        cmd = [sys.executable, "-m", "pagedllm.partition.netem", "--upstream", upstream,
               "--rtt-ms", str(rtt_ms), "--jitter-ms", str(jitter_ms),
               "--loss", str(loss)]  # fmt: skip
        if netns:
            cmd += ["--netns", netns]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("proxy on"):
            self.process.kill()
            raise NetemError(f"the delaying proxy did not start: {line!r}")
        words = line.split()
        self.address, control = words[2], words[4]
        host, port = control.rsplit(":", 1)
        self._control = socket.create_connection((host, int(port)))
        self._control_file = self._control.makefile("r")

    def command(self, line: str) -> str:
        self._control.sendall((line + "\n").encode())
        reply = self._control_file.readline().strip()
        if not reply.startswith("ok"):
            raise ValueError(f"proxy: {reply}")
        return reply

    def set(self, **shape: float) -> None:
        """Change rtt_ms / jitter_ms / loss from now on."""
        self.command("set " + " ".join(f"{k}={v}" for k, v in shape.items()))

    def down(self) -> None:
        self.command("down")

    def up(self) -> None:
        self.command("up")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._control.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="A delaying TCP proxy (see pagedllm.partition.netem)."
    )
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--netns", default=None, help="namespace the upstream side connects from")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))

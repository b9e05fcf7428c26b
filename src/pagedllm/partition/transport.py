"""The wire between two tiers: one gRPC (HTTP/2) bidirectional stream per edge session.

Each message is a safetensors buffer: the step's tensors plus a JSON header in its
metadata. Replies come back in the order of the requests; several requests may be in
flight (a pipelined edge). The server reads requests on a thread of its own and answers
them in order from the session's stream, so a handler may return a deferred reply (a
callable the stream calls when that reply is due: a tier in between hands the step on
and is free for the next one while the tiers after it work). A cloud worker serves one
edge at a time (its KV cache is indexed by that edge's block ids); when the stream ends,
for whatever reason, the worker's ``on_close`` frees the session's state.

The link can be emulated (``emulate``: a LinkProfile): before each reply the server sleeps
one RTT plus both messages' bytes over the bandwidth, as a real link of that profile would
add to the exchange. The overhead field of the profile is not slept: it is the software
cost the transport itself has.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pagedllm.partition.profiles import LinkProfile

try:
    import grpc
except ImportError as e:  # an optional dependency: only the split talks gRPC
    raise ImportError(
        "the edge/cloud split needs the grpcio package, which is not installed: "
        "pip install 'pagedllm[split]'",
        name="grpc",
    ) from e

logger = logging.getLogger(__name__)

SESSION_METHOD = "/pagedllm.partition.Tier/Session"
# Messages carry a whole prefill's hidden states: lift gRPC's 4 MiB default. Keepalive pings
# find a peer that vanished without closing its socket.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]

Message = tuple[dict[str, Any], dict[str, torch.Tensor]]
# A reply now, or one later: the callable is called (and may wait) when the reply is due.
Reply = Message | Callable[[], Message]
Handler = Callable[[dict[str, Any], dict[str, torch.Tensor]], Reply]
READER_JOIN_S = 5.0  # at a session's end: how long its request reader may take to stop


class PeerLostError(ConnectionError):
    """The other tier went away (or never answered); its state for this session is gone."""


class RemoteError(RuntimeError):
    """The other tier answered with an error instead of a result."""


def pack(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()}, {"meta": json.dumps(meta)})


def unpack(data: bytes) -> Message:
    # safetensors layout: u64 little-endian header length, then the JSON header
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"]["meta"])
    return meta, st_load(data)


class TierServer:
    """Serves the session stream of one edge at a time on a gRPC server."""

    def __init__(
        self,
        handler: Handler,
        on_close: Callable[[], None],
        address: str,
        emulate: LinkProfile | None = None,
    ) -> None:
        self._handler, self._on_close, self._emulate = handler, on_close, emulate
        self._busy = threading.Lock()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS
        )
        method = grpc.stream_stream_rpc_method_handler(self._session)
        service, name = SESSION_METHOD.rsplit("/", 1)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.strip("/"), {name: method}),)
        )
        host = address.rsplit(":", 1)[0]
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        self._server.start()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace: float | None = 1.0) -> None:
        self._server.stop(grace).wait()

    def _session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        if not self._busy.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "this cloud worker already serves an edge"
            )
        logger.info("edge %s connected", context.peer())
        pending: queue.SimpleQueue[tuple[bytes, Reply | Exception] | None] = queue.SimpleQueue()
        reader = threading.Thread(target=self._read, args=(requests, pending), daemon=True)
        reader.start()
        try:
            while (item := pending.get()) is not None:
                request, reply = item
                data = self._packed(reply)
                if self._emulate is not None:
                    link = self._emulate
                    time.sleep(link.rtt_ms / 1e3 + link.transfer_s(len(request) + len(data)))
                yield data
        finally:
            logger.info("edge %s disconnected; freeing its session", context.peer())
            reader.join(READER_JOIN_S)  # no step of this session may land on the next one
            if reader.is_alive():
                logger.warning("a step of the ended session is still running")
            self._on_close()
            self._busy.release()

    def _read(self, requests: Iterator[bytes], pending: queue.SimpleQueue) -> None:
        """Handle the session's requests as they come, queueing their replies in order."""
        try:
            for request in requests:
                try:
                    reply: Reply | Exception = self._handler(*unpack(request))
                except Exception as e:  # noqa: BLE001 - the edge gets the reason
                    reply = e
                pending.put((request, reply))
        except grpc.RpcError:
            pass  # the session ended under the reader
        finally:
            pending.put(None)

    @staticmethod
    def _packed(reply: Reply | Exception) -> bytes:
        try:
            if isinstance(reply, Exception):
                raise reply
            return pack(*(reply() if callable(reply) else reply))
        except Exception as e:  # the edge gets the reason, the worker stays up
            logger.error("step failed: %s: %s", type(e).__name__, e, exc_info=e)
            return pack({"error": f"{type(e).__name__}: {e}"}, {})


class TierClient:
    """The edge's end of the session stream: exchange() sends one message, returns the reply."""

    def __init__(
        self, address: str, connect_timeout_s: float = 30.0, reply_timeout_s: float | None = None
    ) -> None:
        self.address = address
        self.reply_timeout_s = reply_timeout_s
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise PeerLostError(
                f"cannot reach the cloud worker at {address} within {connect_timeout_s:.0f}s"
            ) from None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        call = self._channel.stream_stream(SESSION_METHOD)
        self._replies = call(iter(self._outbox.get, None))
        # An edge dropped without close() still ends its session, so the worker is free.
        self._finalizer = weakref.finalize(self, _end_session, self._outbox, self._channel)

    def exchange(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        self.send(meta, tensors)
        return self.receive()

    def send(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Queue one message; replies come back in order (receive), so several may be in
        flight: the other tier works on one while this one prepares the next."""
        self._outbox.put(pack(meta, tensors))

    def receive(self) -> Message:
        """The reply to the oldest message sent and not yet answered."""
        # A link that drops everything leaves the socket open and silent: keepalive would
        # notice only after its timeouts, so a reply that is this late ends the session.
        timer = None
        if self.reply_timeout_s is not None:
            timer = threading.Timer(self.reply_timeout_s, self._replies.cancel)
            timer.daemon = True
            timer.start()
        try:
            reply_meta, reply_tensors = unpack(next(self._replies))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and timer is not None:
                raise PeerLostError(
                    f"no reply from the cloud worker at {self.address} within "
                    f"{self.reply_timeout_s:g}s: the link or the worker is lost"
                ) from None
            raise PeerLostError(
                f"lost the connection to the cloud worker at {self.address}: "
                f"{e.code().name}: {e.details()}"
            ) from None
        except StopIteration:
            raise PeerLostError(f"the cloud worker at {self.address} closed the session") from None
        finally:
            if timer is not None:
                timer.cancel()
        if "error" in reply_meta:
            raise RemoteError(f"cloud worker at {self.address}: {reply_meta['error']}")
        return reply_meta, reply_tensors

    def close(self) -> None:
        self._finalizer()


def link_ready(address: str, timeout_s: float) -> bool:
    """Whether a gRPC connection to address comes up within timeout_s (TCP and HTTP/2)."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def _end_session(outbox: queue.SimpleQueue, channel: grpc.Channel) -> None:
    outbox.put(None)
    channel.close()


def measure_overhead_ms(payload_bytes: int = 4096, repeats: int = 50) -> float:
    """Median software cost of one exchange over loopback (pack, gRPC, unpack), in ms: the
    ``overhead_ms`` of a LinkProfile for this machine."""
    server = TierServer(lambda meta, tensors: ({}, {}), lambda: None, "127.0.0.1:0")
    server.start()
    client = TierClient(server.address, reply_timeout_s=60.0)  # as the edge runs it
    payload = {"hidden": torch.zeros(max(1, payload_bytes // 2), dtype=torch.bfloat16)}
    try:
        times = []
        for _ in range(repeats + 5):
            start = time.perf_counter()
            client.exchange({"kind": "ping"}, payload)
            times.append(time.perf_counter() - start)
    finally:
        client.close()
        server.stop(None)
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e3

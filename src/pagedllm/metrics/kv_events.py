"""KV-cache events on the wire, in vLLM's format: ZeroMQ PUB + msgpack, with a replay socket.

The block manager records what its prefix cache gains and loses (core/kv_events.py). After
every step, on the engine thread, ``KVEventPublisher.record`` takes those events (a list swap)
and queues them as one batch; a thread of its own encodes and sends it, so the step never
waits on a socket. A prefix-aware router (vllm-router's kv_aware policy, llm-d's KV indexer,
Dynamo) subscribes and learns which replica holds which prefix.

Wire format (vLLM's ``KVEventBatch`` as msgspec encodes it since vLLM made its events tagged
maps, vllm-project/vllm#42892; routers built for current vLLM, vllm-router among them, reject
the older positional events):

- a message is three frames: ``topic``, the batch's sequence number (8 bytes, big-endian,
  from 0), the msgpack payload;
- the payload is the array ``[ts, [event, ...], data_parallel_rank]``;
- each event is a map tagged by ``type``: ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``,
  ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``;
  fields vLLM leaves out at their defaults (``extra_keys``, ``group_idx`` ...) are left out.
  Hashes are unsigned 64-bit integers (the engine's chained block hashes modulo 2**64),
  ``lora_id`` and ``lora_name`` are None (no adapters), ``medium`` is where the blocks live
  ("GPU" on CUDA, "CPU" on the CPU).

Replay: with ``replay_endpoint``, a ROUTER socket answers a request ``[b"", start_seq]``
(8 bytes, big-endian) with every buffered batch from start_seq on, ``[b"", seq, payload]``
each, then ``[b"", -1 (8 bytes, signed), b""]``, so a late subscriber catches up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventLog,
)
from pagedllm.core.stats import IterationStats, SchedulerStats
from pagedllm.kv_events_config import KVEventsConfig

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.block_manager import BlockManager

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1
_POLL_S = 0.05  # the thread's longest wait: how late a replay request may be answered


def wire_event(event: KVCacheEvent, medium: str) -> dict[str, Any]:
    """One event as vLLM's tagged msgspec struct: the tag under "type", then its fields."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else event.parent_block_hash & _U64
        return {
            "type": "BlockStored",
            "block_hashes": [h & _U64 for h in event.block_hashes],
            "parent_block_hash": parent,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        hashes = [h & _U64 for h in event.block_hashes]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: list[KVCacheEvent], medium: str, data_parallel_rank: int = 0
) -> bytes:
    import msgpack

    return msgpack.packb([ts, [wire_event(e, medium) for e in events], data_parallel_rank])


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard address (or ipc://, inproc://) binds, any other connects
    (to a subscriber or proxy that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """A stat logger that publishes the block manager's KV-cache events (see the module doc).

    A batch that finds the queue full (a subscriber-less socket never blocks, so only a
    stalled thread fills it) is dropped and counted in ``dropped_batches``.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        log: KVEventLog,
        medium: str,
        data_parallel_rank: int = 0,
    ) -> None:
        try:
            import msgpack  # noqa: F401 - checked here so that a missing one fails at start
            import zmq
        except ImportError as e:
            raise ValueError(
                f"kv_events_config needs pyzmq and msgpack ({e.name} is missing): "
                "pip install 'pagedllm[kv-events]'"
            ) from e
        self.config = config
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.dropped_batches = 0
        self._log = log
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open its endpoints: {e}") from e
        # The sockets were made here (so a taken port fails at start) and are used only by the
        # thread from now on: ZeroMQ allows handing a socket over to another thread.
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: Any, endpoint: str) -> None:
        if binds(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    @property
    def published_batches(self) -> int:
        return self._next_seq

    # ---- the StatLogger protocol (engine thread) -------------------------------------------
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        if not len(self._log):
            return
        try:
            self._queue.put_nowait((time.time(), self._log.take()))
        except queue.Full:
            self.dropped_batches += 1

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)

    # ---- the publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays()
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        except Exception:  # noqa: BLE001 - events are advisory: never take the engine down
            logger.exception("the KV-event publisher stopped")
        finally:
            self._close_sockets()

    def _send(self, ts: float, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(ts, events, self.medium, self.data_parallel_rank)
        seq = self._next_seq
        topic = self.config.topic.encode()
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replays(self) -> None:
        import zmq

        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV-event replay request")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)  # a moment to flush the last batch
        self._ctx.term()


def publisher_for(config: EngineConfig, block_manager: BlockManager) -> KVEventPublisher:
    """A publisher of this engine's block manager (an EngineConfig with kv_events set): turns
    the block manager's event log on and names the medium after the engine's device."""
    assert config.kv_events is not None
    block_manager.events = KVEventLog()
    medium = "GPU" if config.device.device == "cuda" else "CPU"
    return KVEventPublisher(config.kv_events, block_manager.events, medium)

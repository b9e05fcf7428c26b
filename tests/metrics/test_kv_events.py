"""KV-cache events reach a real ZeroMQ subscriber in vLLM's wire format: decoded with msgspec
structs declared as vLLM declares them (tagged events, an array-like batch), the batches
carry what the prefix cache gained (the prompt's full blocks, their hash chain), what it
lost (evictions) and when it was cleared; the replay socket hands a late subscriber the
same bytes."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm.kv_events_config import parse_kv_events_config

BLOCK = 16
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(70)]  # 4 full blocks of 16 and 6 tokens more


# ---- vLLM's structs, as a router declares them to decode the stream ------------------------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def engine(tiny_llama):
    ports = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
        "topic": "kv",
    }
    args = EngineArgs(
        model=str(tiny_llama),
        block_size=BLOCK,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 20,
        kv_events_config=config,
    )
    engine = LLMEngine.from_engine_args(args)
    yield engine, ports
    engine.shutdown()


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()


class Subscriber:
    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.messages: list[tuple[int, bytes]] = []  # (seq, payload)

    def receive(self, timeout_ms: int = 200) -> list[KVEventBatch]:
        batches = []
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.messages.append((int.from_bytes(seq, "big"), payload))
            batches.append(DECODER.decode(payload))
            timeout_ms = 0
        return batches

    def until(self, engine: LLMEngine, wanted: Any, timeout: float = 30) -> list[Any]:
        """Events (steps driven meanwhile) until wanted(events) holds."""
        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for batch in self.receive():
                assert batch.data_parallel_rank == 0 and batch.ts > 0
                events.extend(batch.events)
            if wanted(events):
                return events
            engine.step()  # an idle step publishes what the last one left
        raise AssertionError(f"not seen in time: {events}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def synchronized(engine: LLMEngine, sub: Subscriber) -> None:
    """A PUB socket drops what it sends before a subscription arrives: probe until one batch
    is heard, then clear the cache so that the test starts from a known point."""
    deadline = time.monotonic() + 30
    for i in range(1000):
        run(engine, f"probe{i}", [11 + i % 200] * 40)
        if sub.receive():
            break
        assert time.monotonic() < deadline, "the subscriber never heard a batch"
    assert engine.block_manager.reset_prefix_cache()
    sub.until(engine, lambda events: any(isinstance(e, AllBlocksCleared) for e in events))


def test_events_reach_a_subscriber_in_vllm_wire_format(engine) -> None:
    engine, (port, replay_port) = engine
    sub = Subscriber(port)
    try:
        synchronized(engine, sub)
        run(engine, "a", PROMPT)
        stored = sub.until(engine, lambda ev: any(isinstance(e, BlockStored) for e in ev))
        (event,) = [e for e in stored if isinstance(e, BlockStored)]
        assert event.token_ids == PROMPT[: 4 * BLOCK] and event.block_size == BLOCK
        assert event.parent_block_hash is None and event.lora_id is None is event.lora_name
        assert event.medium == "CPU"
        assert len(event.block_hashes) == 4 and len(set(event.block_hashes)) == 4
        assert all(0 <= h < 2**64 for h in event.block_hashes)
        # the same prompt again is a prefix hit: nothing new is stored
        queries_hits = engine.block_manager.prefix_cache_hits
        run(engine, "b", PROMPT)
        assert engine.block_manager.prefix_cache_hits == queries_hits + 4 * BLOCK
        assert not [e for e in sub.until(engine, lambda ev: True) if isinstance(e, BlockStored)]
        # other prompts fill the cache until the prompt's blocks are evicted
        mine = set(event.block_hashes)
        removed: set[int] = set()
        for i in range(engine.kv_cache.num_blocks):
            run(engine, f"fill{i}", [3 + (i * 7 + j * 13) % 290 for j in range(4 * BLOCK + 1)])
            for e in sub.until(engine, lambda ev: True):
                if isinstance(e, BlockRemoved):
                    assert e.medium == "CPU"
                    removed.update(e.block_hashes)
            if mine <= removed:
                break
        assert mine <= removed
        seqs = [seq for seq, _ in sub.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap, in order
        replayed = replay(replay_port, start=seqs[0])
        assert replayed[: len(sub.messages)] == sub.messages  # the same bytes
    finally:
        sub.close()


def replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER socket for every batch from start; collect them up to the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"enable_kv_cache_events": true, "endpoint": 5}', "endpoint must be str"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown fields ['port']"),
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher must be one of"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_config_names_the_field(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_kv_events_config(raw)


def test_config_off_means_no_publisher() -> None:
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config({"enable_kv_cache_events": False}) is None
    assert parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}) is None
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "t"}')
    assert on is not None and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"

"""Load: 200 concurrent streaming clients of mixed lengths, a fifth of them leaving midway, in
repeated rounds against one server. No 5xx; every stream that runs to its end is well-formed
and holds exactly the engine's greedy text; nothing leaks; memory stays flat across rounds."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest
from helpers.engine import MAX_MODEL_LEN, MODEL, engine_args
from helpers.generation import GREEDY

from pagedllm import SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.engine.llm_engine import LLMEngine

CLIENTS = 200
ROUNDS = 5
ROUND_TIMEOUT = 120.0  # seconds: a round that has not ended by then hangs


@dataclass(frozen=True)
class Client:
    prompt: list[int]
    max_tokens: int
    leave_after: int | None  # events read before disconnecting; None: read to the end


def make_clients(seed: int = 0) -> list[Client]:
    """Prompts of 1-60 tokens; most ask for 1-16 tokens, one in five leaves after 1-3 events
    of a request for all the tokens max_model_len allows (it would run long if not aborted)."""
    rng = random.Random(seed)
    clients = []
    for _ in range(CLIENTS):
        prompt = [rng.randrange(10, 310) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.2:
            clients.append(Client(prompt, MAX_MODEL_LEN - len(prompt), rng.randint(1, 3)))
        else:
            clients.append(Client(prompt, rng.randint(1, 16), None))
    return clients


@pytest.fixture(scope="module")
def expected_texts(tiny_llama) -> list[str]:
    """Each client's greedy text, from an offline engine."""
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama))
    texts: dict[str, str] = {}
    for i, c in enumerate(make_clients()):
        engine.add_request(str(i), c.prompt, SamplingParams(max_tokens=c.max_tokens, **GREEDY))
    while engine.has_unfinished_requests():
        texts.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    return [texts[str(i)] for i in range(CLIENTS)]


async def stream_one(client: httpx.AsyncClient, url: str, c: Client) -> tuple[int, list | None]:
    """(HTTP status, the stream's events, or None when the client left midway)."""
    body = {
        "prompt": c.prompt,
        "max_tokens": c.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    events: list = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if c.leave_after is not None and len(events) >= c.leave_after:
                    return r.status_code, None  # leaving the block drops the connection
            else:
                assert line == "", line  # events are separated by one blank line
    return r.status_code, events


def check_stream(events: list, c: Client, expected: str) -> None:
    """Complete and well-formed: one id, text chunks, a finish, the usage, then [DONE]."""
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert len({e["id"] for e in events[:-1]}) == 1
    assert all(e["object"] == "text_completion" and e["model"] == MODEL for e in events[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == c.max_tokens
    reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected


async def one_round(url: str, clients: list[Client]) -> list[tuple[int, list | None]]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=ROUND_TIMEOUT, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, url, c) for c in clients))


def live_streams(engine: AsyncLLMEngine) -> list[RequestStream]:
    """The request streams of this engine still in memory (after a full collection)."""
    gc.collect()
    streams = [o for o in gc.get_objects() if type(o) is RequestStream]
    return [s for s in streams if getattr(s._on_abort, "__self__", None) is engine]


def ended(server, reason: str) -> float:  # noqa: ANN001
    """Requests that ended for this reason ("length", "abort"), as the server's metrics count
    them."""
    labels = {"model_name": MODEL, "engine": "0", "finished_reason": reason}
    registry = server.app.state.metrics.registry
    return registry.get_sample_value("vllm:request_success_total", labels) or 0.0


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_200_streaming_clients_in_rounds(serve, expected_texts) -> None:
    server = serve()
    clients = make_clients()
    rss: list[int] = []
    for _ in range(ROUNDS):
        lengths_before, aborts_before = ended(server, "length"), ended(server, "abort")
        # the deadline only ends a hung round (TimeoutError); how long a round takes is the
        # machine's business
        results = asyncio.run(asyncio.wait_for(one_round(server.url, clients), ROUND_TIMEOUT))
        assert [status for status, _ in results] == [200] * CLIENTS  # no 5xx, no 4xx
        finished = 0
        for (_, events), c, expected in zip(results, clients, expected_texts):
            if events is not None:
                check_stream(events, c, expected)
                finished += 1
        assert finished == sum(c.leave_after is None for c in clients)
        server.wait_idle()
        # Every request ended, each read to its end for its length. A leaver is aborted when its
        # disconnect reaches the server; one whose last token the engine made first (how late
        # the disconnect arrives depends on the machine's load) ends for its length instead, so
        # how many of the leavers are aborts is not fixed; that some are, is.
        lengths = ended(server, "length") - lengths_before
        aborts = ended(server, "abort") - aborts_before
        assert lengths + aborts == CLIENTS
        assert lengths >= finished
        assert aborts > 0
        assert server.on_engine(lambda e: len(server.engine._streams)) == 0
        deadline = time.monotonic() + 10  # the server's handlers of the last round may linger
        while live_streams(server.engine):
            assert time.monotonic() < deadline, "request streams outlive their requests"
            time.sleep(0.1)
        rss.append(rss_bytes())
    growth = rss[-1] - rss[1]  # the first round warms caches and pools up
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over {ROUNDS - 2} rounds"

"""The OpenAI-compatible server, started for real on a free port, driven by the official
``openai`` client and by raw HTTP (httpx).

The server runs in a thread of the test process (``serve_in_thread``) so that the tests can
reach its engine: integrity checks and KV usage are read on the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from helpers.engine import engine_args, on_call, patch_execute_model
from helpers.sse import sse_events

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

MODEL = "tiny"
MAX_MODEL_LEN = 256


@dataclass
class Server:
    url: str
    engine: AsyncLLMEngine
    app: object

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def on_engine(self, fn):  # noqa: ANN001, ANN201
        return self.engine.submit(fn).result(timeout=30)

    def successes(self, reason: str) -> float:
        labels = {"model_name": MODEL, "engine": "0", "finished_reason": reason}
        value = self.app.state.metrics.registry.get_sample_value(
            "vllm:request_success_total", labels
        )
        return value or 0.0

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine holds no request; then integrity and zero KV usage hold."""
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.02)
        self.on_engine(lambda e: e.check_integrity())
        assert self.on_engine(lambda e: e.block_manager.usage) == 0.0


@pytest.fixture(scope="module")
def server(tiny_llama):
    app = build_app(
        engine_args(tiny_llama, max_model_len=MAX_MODEL_LEN), [MODEL], log_stats_interval=None
    )
    with serve_in_thread(app) as url:
        yield Server(url, app.state.engine, app)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(**vars(engine_args(tiny_llama, max_model_len=MAX_MODEL_LEN)))


# ---- completions and chat ----------------------------------------------------------------
def test_completion_matches_offline_engine(server, offline) -> None:
    prompts = ["The quick brown fox", "A list is a"]
    result = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0.0
    )
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [c.index for c in result.choices] == [0, 1]
    assert [c.text for c in result.choices] == [o.outputs[0].text for o in expected]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    generated = sum(len(o.outputs[0].token_ids) for o in expected)
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == generated
    assert result.usage.total_tokens == prompt_tokens + generated
    assert result.model == MODEL and result.object == "text_completion"


def test_token_id_prompt_and_echo(server) -> None:
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "The quick"}).json()["tokens"]
    plain = server.client().completions.create(
        model=MODEL, prompt="The quick", max_tokens=6, temperature=0.0
    )
    by_ids = server.client().completions.create(
        model=MODEL, prompt=tokens, max_tokens=6, temperature=0.0, echo=True
    )
    assert by_ids.choices[0].text == "The quick" + plain.choices[0].text


def test_streamed_completion_concatenates_to_the_plain_one(server) -> None:
    kwargs = dict(model=MODEL, prompt="Dictionaries map", max_tokens=20, temperature=0.0)
    plain = server.client().completions.create(**kwargs)
    chunks = list(
        server.client().completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    # How many chunks there are is not fixed: a stream's outputs are deltas, and when the
    # reader is behind the engine the stream adds the newer ones to the one it holds, so a
    # chunk holds all the text since the last one (no text is lost, as the join below shows).
    # That a stream delivers text while the request still runs: test_streaming_client_*.
    assert text_chunks and all(c.choices[0].text for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in text_chunks)


def test_raw_sse_framing(server) -> None:
    body = {"prompt": "The quick", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    first = json.loads(blocks[0][len("data: ") :])
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")


def test_chat_completion_and_stream(server, offline) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    plain = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0.0
    )
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == expected.outputs[0].text
    assert plain.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 16


def test_n_choices_with_seed_stream_like_plain(server) -> None:
    kwargs = dict(model=MODEL, prompt="The quick", max_tokens=10, temperature=1.0, n=2, seed=7)
    plain = server.client().completions.create(**kwargs)
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.choices[0].text != plain.choices[1].text  # distinct samples (seed + index)
    again = server.client().completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in plain.choices]
    streamed = {0: "", 1: ""}
    for chunk in server.client().completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in plain.choices]
    assert plain.usage.completion_tokens == 20


def test_completion_logprobs_match_engine(server, offline) -> None:
    result = server.client().completions.create(
        model=MODEL, prompt="The quick", max_tokens=8, temperature=0.0, logprobs=3
    )
    lp = result.choices[0].logprobs
    expected = offline.generate(
        "The quick", SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    )[0].outputs[0]
    want = [entry[t].logprob for t, entry in zip(expected.token_ids, expected.logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(token_lp)  # greedy picks the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(server) -> None:
    result = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_stop_string(server) -> None:
    kwargs = dict(model=MODEL, prompt="The quick brown", max_tokens=30, temperature=0.0)
    text = server.client().completions.create(**kwargs).choices[0].text
    cut = next(
        k
        for k in range(3, len(text) - 2)
        if text[k : k + 2].isalnum() and text.find(text[k : k + 2]) == k
    )
    stop = text[cut : cut + 2]
    stopped = server.client().completions.create(**kwargs, stop=[stop])
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in server.client().completions.create(**kwargs, stop=stop, stream=True)
    )
    assert streamed == text[:cut]


def test_concurrent_http_requests_share_the_batch(server) -> None:
    prompts = [f"The quick brown fox {i}" for i in range(8)]
    peak = {"running": 0}

    class Peak:
        def record(self, scheduler_stats, iteration_stats) -> None:  # noqa: ANN001
            peak["running"] = max(peak["running"], scheduler_stats.num_running)

    peak_logger = Peak()
    server.on_engine(lambda e: e.add_stat_logger(peak_logger))

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = await client.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def main() -> list[str]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    # The engine thread waits until every request is queued: they all join the first step,
    # however the clients' requests are spread out in time.
    gate, queued = threading.Event(), []
    server.engine.submit(lambda e: gate.wait(60))

    def open_gate() -> None:
        deadline = time.monotonic() + 30
        while server.engine._commands.qsize() < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        queued.append(server.engine._commands.qsize())
        gate.set()

    opener = threading.Thread(target=open_gate)
    opener.start()
    try:
        together = asyncio.run(main())
    finally:
        gate.set()
        opener.join()
        server.on_engine(lambda e: e.stat_loggers.remove(peak_logger))
    assert queued == [len(prompts)]
    alone = [
        server.client()
        .completions.create(
            model=MODEL, prompt=p, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert together == alone
    assert peak["running"] == len(prompts)  # all of them decoded in the same steps
    server.wait_idle()


# ---- other endpoints ---------------------------------------------------------------------
def test_models_tokenize_detokenize_health_version(server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "The quick"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "The quick"
    chat_tok = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat_tok["count"] > tok["count"] - 2  # the template adds role markers
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    server.app.state.monitor.record_metric("app_queue_depth", 7)  # user metrics, same endpoint
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"}' in metrics.text
    assert 'pagedllm:app_queue_depth{model_name="tiny"} 7.0' in metrics.text


# ---- errors ------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": [1000000]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, "messages"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


def test_bad_requests_get_400_and_leave_others_alone(server) -> None:
    kwargs = dict(model=MODEL, prompt="A list is", max_tokens=60, temperature=0.0)
    expected = server.client().completions.create(**kwargs).choices[0].text
    streamed: list[str] = []

    def long_stream() -> None:
        for chunk in server.client().completions.create(**kwargs, stream=True):
            streamed.append(chunk.choices[0].text)

    worker = threading.Thread(target=long_stream)
    worker.start()
    for path, body, param in BAD_REQUESTS:
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], body
        assert error["param"] == param, (body, error)
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for stream in (False, True):  # a stream request is refused before its stream starts
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": "x", "n": 0, "stream": stream}
        )
        assert r.status_code == 400
    worker.join(timeout=60)
    assert "".join(streamed) == expected
    server.wait_idle()


def test_overload_answers_503(server) -> None:
    engine = server.engine
    previous, engine.max_waiting_requests = engine.max_waiting_requests, 1
    gate = threading.Event()
    engine.submit(lambda e: gate.wait(30))  # holds the engine thread so requests queue up
    results: list[httpx.Response] = []

    def post() -> None:
        body = {"prompt": "The quick", "max_tokens": 4}
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))

    try:
        workers = [threading.Thread(target=post) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 10
        while engine._commands.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # until all three adds wait behind the gate
        assert engine._commands.qsize() == 3  # the precondition of what follows
    finally:
        gate.set()
        for w in workers:
            w.join(timeout=60)
        engine.max_waiting_requests = previous  # the module's server serves on
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 503, 503], [r.text for r in results]
    error = next(r for r in results if r.status_code == 503).json()["error"]
    assert "overloaded" in error["message"] and error["type"] == "server_error"
    server.wait_idle()


# ---- client disconnects ------------------------------------------------------------------
@pytest.fixture()
def slow_model(server, monkeypatch):
    """Every engine step takes >= 20 ms, so 200 tokens take seconds."""
    patch_execute_model(monkeypatch, server.engine.engine.executor, delay=0.02)


LONG = {"prompt": "The quick", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def test_streaming_client_disconnect_aborts(server, slow_model) -> None:
    finished_before = server.successes("length")
    aborted_before = server.successes("abort")
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST", server.url + "/v1/completions", json={**LONG, "stream": True}
        ) as r:
            lines = r.iter_lines()
            events = sse_events(line for line, _ in zip(lines, range(4)))
            assert len(events) >= 2
            assert server.on_engine(lambda e: e.has_unfinished_requests())
    # Closing the response drops the connection; the server aborts the request: counted as
    # an abort, not as a request that ran to its 200 tokens.
    server.wait_idle(timeout=60.0)
    assert server.successes("length") == finished_before
    assert server.successes("abort") == aborted_before + 1  # vLLM's finished_reason="abort"


def test_non_streaming_client_disconnect_aborts(server, slow_model) -> None:
    finished_before = server.successes("length")
    aborted_before = server.successes("abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    server.wait_idle(timeout=60.0)
    assert server.successes("length") == finished_before
    assert server.successes("abort") == aborted_before + 1


# ---- engine failures ---------------------------------------------------------------------
@pytest.fixture()
def failing_step(server, monkeypatch):
    """The model raises on the 3rd step from now, once."""
    fault = on_call(3, RuntimeError("device lost"))
    patch_execute_model(monkeypatch, server.engine.engine.executor, fault=fault)


def test_engine_failure_mid_stream_is_an_error_event(server, failing_step) -> None:
    body = {**LONG, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "device lost" in error["message"]
    server.wait_idle()
    ok = server.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert ok.usage.completion_tokens == 3  # the engine carries on


def test_engine_failure_without_stream_is_a_500(server, failing_step) -> None:
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 20}, timeout=30)
    assert r.status_code == 500
    assert "device lost" in r.json()["error"]["message"]
    server.wait_idle()

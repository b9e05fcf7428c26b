"""Property-based fuzzing of the HTTP API: hypothesis builds request bodies field by field from
plausible values (mostly) and junk of every JSON type (sometimes), plus raw bytes. Whatever
comes in, the server answers below 500 with a well-formed body, and afterwards the engine holds
no request and no block."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.engine import MODEL
from helpers.sse import sse_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 150  # about 15 s on a loaded 2-core machine

TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from([" ", "\ud800", "a\udfffb", "\x00", "é🙂", "{{ x }}", "The quick"]),
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.lists(st.integers(-3, 400), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2),
)
IDS = st.lists(st.integers(0, 319), min_size=1, max_size=10)  # the vocabulary is [0, 320)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"])},
    optional={
        "content": st.one_of(
            TEXT,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        )
    },
)

# Values inside each field's range: an unmutated body reaches the engine and runs.
VALID = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT.filter(bool), IDS, st.lists(IDS, min_size=1, max_size=3))},
    optional={**VALID, "logprobs": st.integers(0, 5), "echo": st.booleans()},
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**VALID, "logprobs": st.booleans()},
)
TOKENIZE = st.fixed_dictionaries({}, optional={"prompt": TEXT, "messages": st.lists(MESSAGE)})
DETOKENIZE = st.fixed_dictionaries({"tokens": IDS})

# Values at or past the edge of a range, and prompts the engine must refuse. Hypothesis draws
# the first keys most often: those reach deepest (the engine, the sampler) when not refused.
EDGE = {
    "seed": st.sampled_from([2**64, -(2**64), 2**63 - 1, -(2**63)]),
    "stop_token_ids": st.sampled_from([[320], [10**20], [-1]]),
    "n": st.sampled_from([129, 10**6, 0]),
    "temperature": st.sampled_from([1e-30, 1e30, -1.0]),
    "repetition_penalty": st.sampled_from([1e30, 0.0]),
    "prompt": st.sampled_from(["", [], [[]], [320], [[5], [-1]], [5] * 200]),
    "stop": st.sampled_from(["", [""], ["\ud800"]]),
    "max_tokens": st.sampled_from([0, 200, 10**30]),
    "min_tokens": st.sampled_from([9, 10**9]),
    "logprobs": st.sampled_from([21, -1, 10**9]),
    "top_p": st.sampled_from([0.0, 1.5]),
    "top_logprobs": st.integers(-1, 21),
    "messages": st.sampled_from([[], [{"role": "user", "content": [{"type": "image"}]}]]),
    "model": st.sampled_from(["other", "\ud800", ""]),
    "tokens": st.sampled_from([[], [320], [-1]]),
    "response_format": st.sampled_from([{"type": "x"}, {}]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["tokenize", "x"]), JUNK),
    "best_of": st.integers(0, 3),
}


def mutated(bodies: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """A quarter of the bodies as drawn; the rest with a field set to an edge value (half) or
    one or two fields set to junk of any type (a quarter)."""
    edge = st.sampled_from(list(EDGE)).flatmap(lambda k: EDGE[k].map(lambda v: {k: v}))
    junk = st.dictionaries(st.sampled_from(list(EDGE)), JUNK, min_size=1, max_size=2)
    mutation = st.one_of(st.just({}), edge, edge, junk)
    return st.tuples(bodies, mutation).map(lambda b: {**b[0], **b[1]})


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), mutated(COMPLETION)),
    st.tuples(st.just("/v1/completions"), mutated(COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), mutated(CHAT)),
    st.tuples(st.just("/v1/chat/completions"), mutated(CHAT)),
    st.tuples(st.just("/tokenize"), mutated(TOKENIZE)),
    st.tuples(st.just("/detokenize"), mutated(DETOKENIZE)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JUNK),
    st.tuples(st.sampled_from(["/v1/completions", "/tokenize"]), st.binary(max_size=40)),
)


def check_response(r: httpx.Response, body: object) -> None:
    """Below 500, and well-formed: an error body, a JSON result or a complete SSE stream."""
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (body, r.status_code)
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (body, error)
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        result = r.json()
        assert "error" not in result, (body, result)
        return
    events = sse_events(r.text)
    assert events[-1] == "[DONE]", (body, r.text)
    for event in events[:-1]:
        assert "error" not in event and event["model"] == MODEL, (body, event)
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    assert any(finishes), (body, r.text)  # every stream ends its choices


@pytest.fixture(scope="module")
def server(serve):
    return serve(max_request_bytes=1 << 16)


def test_fuzzed_requests_never_5xx_and_leak_nothing(server) -> None:
    client = httpx.Client(base_url=server.url, timeout=60)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples in every CI run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=REQUESTS)
    def one(request: tuple[str, object]) -> None:
        path, body = request
        if isinstance(body, bytes):
            content = body
        else:
            content = json.dumps(body).encode()  # NaN / Infinity as Python writes them
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        check_response(r, body)

    try:
        one()
    finally:
        client.close()
    server.wait_idle()
    assert httpx.get(server.url + "/health").status_code == 200

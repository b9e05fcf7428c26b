"""Bad input, offline and over HTTP: every field out of range or of the wrong type, bad prompts,
bad bodies. Each is a clear error (a ValueError naming the field / a 400 with an OpenAI-style
body), and a request already running meanwhile ends with exactly the output it has alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from helpers.engine import MAX_MODEL_LEN, MODEL, assert_no_leak, engine_args, run_to_end
from helpers.generation import GREEDY, greedy_params
from helpers.sse import sse_events

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import MAX_N, LLMEngine
from pagedllm.sampling_params import MAX_LOGPROBS

NAN, INF = float("nan"), float("inf")

# (field, value): SamplingParams refuses each with a ValueError whose message starts with field.
SAMPLING_FIELD_ERRORS = [
    ("n", 0), ("n", 1.5), ("n", True), ("n", "2"),
    ("temperature", -0.1), ("temperature", NAN), ("temperature", "hot"), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", INF),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("frequency_penalty", NAN),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", "7"), ("seed", 1.5),
    ("stop", 5), ("stop", [""]), ("stop", [1]), ("stop", {"x"}),
    ("stop_token_ids", 5), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 17),  # min_tokens above max_tokens (16)
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("logprobs", 2.0),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("detokenize", None),
    ("include_stop_str_in_output", 0), ("spaces_between_special_tokens", "no"),
]  # fmt: skip


@pytest.mark.parametrize("field,value", SAMPLING_FIELD_ERRORS)
def test_sampling_params_name_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


# (prompt, params, message pattern): what the engine itself refuses at add_request.
ENGINE_ERRORS = [
    ("", greedy_params(4), "prompt must not be empty"),
    ([], greedy_params(4), "prompt must not be empty"),
    ([5, 320], greedy_params(4), r"prompt token id 320 is outside the vocabulary \[0, 320\)"),
    ([-1], greedy_params(4), "outside the vocabulary"),
    ([True, 5], greedy_params(4), "outside the vocabulary"),
    ([5.0], greedy_params(4), "outside the vocabulary"),
    ([5] * (MAX_MODEL_LEN + 1), greedy_params(4), "more than max_model_len"),
    ("text \ud800 with a lone surrogate", greedy_params(4), "^prompt is not valid UTF-8"),
    (42, greedy_params(4), "^prompt must be a string or a list of token ids"),
    ("x", SamplingParams(n=MAX_N + 1), f"^n must be at most {MAX_N}"),
    ("x", SamplingParams(seed=2**64, temperature=1.0), "^seed must be a 64-bit integer"),
    ("x", SamplingParams(seed=2**63 - 1, n=2), "^seed must be a 64-bit integer"),
    ("x", SamplingParams(stop_token_ids=[320], min_tokens=2), "^stop_token_ids .* vocabulary"),
    ("x", "greedy", "sampling_params must be a SamplingParams"),
]


def test_engine_refuses_bad_requests_and_running_one_is_unchanged(tiny_llama) -> None:
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama))
    prompt = [7, 8, 9, 10, 11]
    engine.add_request("alone", prompt, greedy_params(40))
    expected = run_to_end(engine)["alone"]
    engine.add_request("live", prompt, greedy_params(40))
    for _ in range(5):
        engine.step()  # "live" is decoding when the bad requests arrive
    for i, (bad_prompt, params, pattern) in enumerate(ENGINE_ERRORS):
        with pytest.raises(ValueError, match=pattern):
            engine.add_request(f"bad-{i}", bad_prompt, params)
        engine.check_integrity()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("live", prompt, greedy_params(4))
    assert list(engine.requests) == ["live"]  # a refused request leaves nothing behind
    assert run_to_end(engine) == {"live": expected}
    assert_no_leak(engine)


# ---- over HTTP ----------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]
LONG_TEXT = "The quick brown fox jumps. " * 40  # far over MAX_MODEL_LEN tokens

# (path, body, param of the error, code of the error or None).
HTTP_ERRORS = [
    # wrong types (pydantic) and values out of range (SamplingParams)
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", None),
    ("/v1/completions", {"prompt": "x", "n": "two"}, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k", None),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, "seed", None),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "stream", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "x"}}, "logit_bias", None),
    # limits: n, logprobs, seed, stop token ids the engine checks
    ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, None, None),
    ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64, "temperature": 1}, None, None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**30], "min_tokens": 1}, None, None),
    # prompts
    ("/v1/completions", {"prompt": ""}, "prompt", None),
    ("/v1/completions", {"prompt": []}, "prompt", None),
    ("/v1/completions", {"prompt": [[]]}, "prompt", None),
    ("/v1/completions", {"prompt": 5}, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, "prompt", None),
    ("/v1/completions", {"prompt": [320]}, None, None),
    ("/v1/completions", {"prompt": [[5], [-1]]}, None, None),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "lone \ud800 surrogate"}, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages",
     None),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages", None),
    ("/v1/chat/completions",
     {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs", None),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", None),
    ("/detokenize", {"tokens": [320]}, "tokens", None),
    # models
    ("/v1/completions", {"model": "other", "prompt": "x"}, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, "model", "model_not_found"),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}, "model", "model_not_found"),
]  # fmt: skip

# Bodies that are not a JSON object of the API: (raw bytes, words the message holds).
RAW_BODIES = [
    (b"{not json", "JSON"),
    (b'{"prompt": "x",}', "JSON"),
    (b"", "required"),
    (b'\xff\xfe{"prompt": "x"}', "parsing the body"),
    (b'{"prompt": "\xc3\x28"}', "parsing the body"),  # invalid UTF-8 inside a string
    (b"[1, 2]", "body"),
    (b'{"prompt": "x", "max_tokens": NaN}', "finite"),
]


def check_error(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI-style error body of r; fails unless r has that status."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert isinstance(error["message"], str) and error["message"]
    return error


def post_json(url: str, body: object) -> httpx.Response:
    """POST body as ASCII JSON: lone surrogates travel as \\ud800 escapes, as JSON allows."""
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=json.dumps(body), headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(serve):
    return serve(max_request_bytes=1 << 20)


def test_http_bad_input_is_400_and_a_running_stream_is_unchanged(server) -> None:
    body = {"prompt": "A list is", "max_tokens": 40, **GREEDY}
    expected = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    expected_text = expected["choices"][0]["text"]
    streamed: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            streamed.append(r.read().decode())

    worker = threading.Thread(target=stream)
    worker.start()
    for path, bad, param, code in HTTP_ERRORS:
        # A streamed request is refused too before its stream starts, with a status.
        for body in [bad] if "stream" in bad else [bad, {**bad, "stream": True}]:
            error = check_error(post_json(server.url + path, body))
            assert (error["param"], error["code"]) == (param, code), (bad, error)
    for raw, words in RAW_BODIES:
        r = httpx.post(
            server.url + "/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert words in check_error(r)["message"], raw
    worker.join(timeout=60)
    events = sse_events(streamed[0])
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text
    server.wait_idle()


def test_huge_bodies_are_413(server) -> None:
    huge = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(
        server.url + "/v1/completions",
        content=huge,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    error = check_error(r, 413)
    assert error["code"] == "request_too_large" and str(1 << 20) in error["message"]

    def chunks():  # no Content-Length: the limit holds for a chunked body too
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * (64 << 10)
        yield b'"}'

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    check_error(r, 413)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert ok.json()["model"] == MODEL
    server.wait_idle()

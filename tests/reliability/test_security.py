"""Security basics: ``--api-key`` guards every route but /health (and /metrics unless told
otherwise) with a constant-time compare, and prompt text stays out of the log at the default
level, whatever happens to the request."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from helpers.engine import MODEL, patch_execute_model

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai import guard

KEY = "sk-test-3f9a"
SECRET = "zebra-secret-prompt-7781"
ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [5]}),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no-such-route", None),
]


@pytest.fixture(scope="module")
def guarded(serve):
    return serve(api_key=KEY)


def call(server, method: str, path: str, body: dict | None, auth: str | None) -> httpx.Response:  # noqa: ANN001
    headers = {"authorization": auth} if auth is not None else {}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"])
def test_every_route_but_health_wants_the_key(guarded, auth: str | None) -> None:
    for method, path, body in ROUTES:
        r = call(guarded, method, path, body, auth)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert call(guarded, "GET", "/health", None, auth).status_code == 200
    assert not guarded.on_engine(lambda e: e.has_unfinished_requests())  # nothing ran


def test_the_key_opens_every_route(guarded, monkeypatch) -> None:
    compared: list[bytes] = []
    real = guard.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(guard.hmac, "compare_digest", recording)
    for auth in (f"Bearer {KEY}", f"bearer {KEY}"):
        for method, path, body in ROUTES:
            r = call(guarded, method, path, body, auth)
            assert r.status_code == (404 if path == "/no-such-route" else 200), (path, r.text)
    assert compared and set(compared) == {KEY.encode()}  # constant-time compare, every time
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_metrics_can_be_left_open(serve) -> None:
    server = serve(api_key=KEY, metrics_need_api_key=False)
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_serve_flags() -> None:
    ns = build_parser().parse_args(
        ["serve", "m", "--api-key", KEY, "--disable-metrics-auth", "--max-request-bytes", "99"]
    )
    assert (ns.api_key, ns.disable_metrics_auth, ns.max_request_bytes) == (KEY, True, 99)
    ns = build_parser().parse_args(["serve", "m"])
    assert (ns.api_key, ns.disable_metrics_auth) == (None, False)
    assert ns.max_request_bytes == guard.DEFAULT_MAX_REQUEST_BYTES
    assert ns.graceful_shutdown_timeout > 0


def test_no_prompt_text_in_logs_at_the_default_level(serve, caplog, monkeypatch) -> None:
    server = serve()
    caplog.set_level(logging.INFO)  # the serve command's default (PAGEDLLM_LOG_LEVEL=INFO)
    url = server.url + "/v1/completions"
    assert httpx.post(url, json={"prompt": SECRET, "max_tokens": 2}).status_code == 200
    assert httpx.post(url, json={"prompt": SECRET, "top_p": 7}).status_code == 400
    assert httpx.post(url, json={"prompt": SECRET * 200, "max_tokens": 2}).status_code == 400
    fault = RuntimeError("injected fault")
    patch_execute_model(monkeypatch, server.engine.engine.executor, fault=lambda n, out: fault)
    assert httpx.post(url, json={"prompt": SECRET, "max_tokens": 2}).status_code == 500
    assert "injected fault" in caplog.text  # the failure is logged ...
    assert SECRET not in caplog.text  # ... but no prompt
    server.wait_idle()

"""schemathesis holds the server to its own /openapi.json: every operation, every check
(status codes and content types documented, responses and stream events matching their
schemas, schema-valid requests accepted, invalid ones refused with a 4xx, 405 with Allow),
with a bounded number of generated cases and a fixed seed.

The one rule no schema can state (prompt tokens + max_tokens within the context) is allowed
by the check in schemathesis_hooks.py, which /openapi.json documents as a 400 code.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.ci import unavailable

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread


@pytest.fixture(autouse=True)
def _schemathesis_installed() -> None:
    if importlib.util.find_spec("schemathesis") is None:
        unavailable("schemathesis is not installed (pip install -e '.[dev]')")


HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


@pytest.fixture(scope="module")
def url(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=128)
    with serve_in_thread(build_app(args, None, log_stats_interval=None)) as base:
        yield base


def test_openapi_documents_the_contract(url) -> None:
    schema = httpx.get(url + "/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"200", "400", "404", "413", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["n"]["minimum"] == 1 and request["n"]["maximum"] == 128
    assert request["echo"]["type"] == "boolean"
    token_id = request["prompt"]["anyOf"][1]["items"]
    assert token_id == {"type": "integer", "minimum": 0, "maximum": 319}  # the tiny vocabulary


def schemathesis_run(url: str, *options: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        url + "/openapi.json",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance",  # replaced by the hook's version
        "--max-examples=10",
        "--seed=13",
        "--no-color",
        *options,
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert "positive_data_acceptance" not in report
    return report


def test_schemathesis_finds_no_failure(url) -> None:
    report = schemathesis_run(url)
    assert "12 selected / 12 total" in report


def test_schemathesis_over_embeddings(tiny_llama) -> None:
    """A server with --runner pooling adds /v1/embeddings, held to the same contract."""
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=128)
    app = build_app(args, None, log_stats_interval=None, runner="pooling")
    with serve_in_thread(app) as base:
        report = schemathesis_run(base, "--include-path=/v1/embeddings")
    assert "1 selected / 13 total" in report

"""``pagedllm serve --speculative-config JSON``: streaming through the openai client works and
/metrics carries the spec-decode counters; a bad config stops start-up with the field named."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
from helpers.process import Output, read_banner, server_url, wait_healthy

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def serve(model: str, spec: dict) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        model,
        "--port=0",
        "--served-model-name=tiny",
        "--kv-cache-memory-bytes=4194304",
        "--uvicorn-log-level=warning",
        "--speculative-config",
        json.dumps(spec),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def test_serve_with_ngram_speculation(tiny_llama) -> None:
    proc = serve(str(tiny_llama), SPEC)
    try:
        url = server_url(read_banner(Output(proc), "metrics", 300))
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompt = "The quick brown fox. The quick brown fox. The quick brown"
        plain = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0.0
        )
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0.0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream)
        assert text == plain.choices[0].text
        assert plain.usage.completion_tokens == 40
        metrics = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=10).text
        drafts = re.search(r"vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)", metrics)
        assert drafts is not None and float(drafts.group(1)) > 0
        assert "vllm:spec_decode_num_accepted_tokens_total" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_bad_speculative_config_names_the_field(tiny_llama) -> None:
    proc = serve(str(tiny_llama), {"method": "ngram", "num_speculative_tokens": -1})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "speculative_config.num_speculative_tokens" in out

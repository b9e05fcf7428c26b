"""`pagedllm bench latency`, `throughput` and `serve`: what they run and report."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from helpers.process import run_cli
from helpers.serve import pagedllm_serve
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import SamplingParams
from pagedllm.entrypoints.bench_cli import Runner, percentile, random_prompts
from pagedllm.entrypoints.cli import build_parser

KV = str(1 << 21)


def test_bench_latency_times_each_run_of_the_whole_batch(model_factory, tmp_path):
    out = tmp_path / "latency.json"
    proc = run_cli(
        "bench", "latency", str(model_factory("llama")), "--dtype", "float32",
        "--input-len", "40", "--output-len", "5", "--batch-size", "3",
        "--num-iters-warmup", "1", "--num-iters", "2",
        "--kv-cache-memory-bytes", KV, "--output-json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Avg latency:" in proc.stdout and "99% percentile latency:" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0
    assert result["output_tokens_per_iter"] == [3 * 5, 3 * 5]  # every request, every token
    # each run starts from an empty prefix cache: the 40-token prompts (2 full blocks each)
    # would otherwise hit the blocks the run before left
    assert result["prefix_cache_hits"] == 0 and result["preemptions"] == 0
    assert result["args"]["batch_size"] == 3


def test_bench_throughput_counts_every_request_and_sample(model_factory, tmp_path):
    out = tmp_path / "throughput.json"
    proc = run_cli(
        "bench", "throughput", "--model", str(model_factory("llama")), "--dtype", "float32",
        "--input-len", "12", "--output-len", "4", "--num-prompts", "5", "--n", "2",
        "--kv-cache-memory-bytes", KV, "--output-json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "requests/s" in proc.stdout and "output tokens/s" in proc.stdout
    result = json.loads(out.read_text())
    assert result["num_requests"] == 5
    assert result["num_output_tokens"] == 5 * 2 * 4
    assert result["total_num_tokens"] == 5 * 12 + 5 * 2 * 4
    assert result["requests_per_second"] == pytest.approx(5 / result["elapsed_time"])


def test_bench_runner_empties_the_prefix_cache_before_each_run(model_factory):
    ns = build_parser("bench").parse_args(
        ["bench", "latency", str(model_factory("llama")), "--dtype", "float32",
         "--input-len", "40", "--output-len", "3", "--batch-size", "2",
         "--kv-cache-memory-bytes", KV]
    )  # fmt: skip
    runner = Runner(ns, ns.batch_size)
    for _ in range(2):
        _, produced = runner.run()
        assert produced == 2 * 3
    assert runner.prefix_hits == 0
    # the same prompts again without emptying the cache do hit: the count above is not idle
    block_manager = runner.llm.llm_engine.block_manager
    before = block_manager.prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runner.llm.generate(runner.prompts, params, use_tqdm=False)
    assert block_manager.prefix_cache_hits > before


@pytest.mark.parametrize(
    ("flag", "value"), [("--num-prompts", "0"), ("--input-len", "0"), ("--n", "0")]
)
def test_bench_rejects_counts_below_one_with_the_flags_name(model_factory, flag, value):
    proc = run_cli("bench", "throughput", str(model_factory("llama")), flag, value)
    assert proc.returncode == 2
    assert f"error: {flag} must be at least 1" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_without_a_benchmark_says_which_there_are():
    proc = run_cli("bench")
    assert proc.returncode == 2 and "BENCHMARK" in proc.stderr
    helped = run_cli("bench", "--help")
    assert "latency" in helped.stdout and "throughput" in helped.stdout


def test_percentile_matches_numpys_linear_interpolation():
    values = [0.31, 0.12, 0.5, 0.27, 0.44, 0.09, 0.38]
    for pct in (0, 10, 25, 50, 75, 90, 99, 100):
        assert percentile(values, pct) == pytest.approx(np.percentile(values, pct))


def test_random_prompts_stay_in_the_vocabulary_and_repeat_with_the_seed():
    prompts = random_prompts(50, 4, 30, seed=7)
    assert [len(p) for p in prompts] == [30] * 4
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert prompts == random_prompts(50, 4, 30, seed=7)
    assert prompts != random_prompts(50, 4, 30, seed=8)


def served_totals(url: str) -> dict[str, float]:
    """The server's requests finished at their length and tokens generated, from /metrics."""
    totals = {"vllm:request_success_total": 0.0, "vllm:generation_tokens_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("finished_reason", "length") == "length":
                totals[sample.name] += sample.value
    return totals


def test_bench_serve_streams_every_request_from_a_live_server(model_factory, tmp_path):
    out = tmp_path / "serve.json"
    with pagedllm_serve(str(model_factory("llama")), "--dtype", "float32") as url:
        before = served_totals(url)
        proc = run_cli(
            "bench", "serve", "--base-url", url + "/v1", "--num-prompts", "4", "--input-len", "10",
            "--output-len", "5", "--request-rate", "50", "--output-json", str(out),
        )  # fmt: skip
        after = served_totals(url)
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "P99 ITL (ms):" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["output_tokens"] == 4 * 5 and result["input_tokens"] == 4 * 10
    assert result["model"] == served  # asked for by name, found through /v1/models
    assert result["args"]["base_url"] == url + "/v1"  # an OpenAI client's base URL works too
    assert 0 < result["ttft_p50_ms"] <= result["e2e_p50_ms"]
    # no inter-token gap where a busy server sent a request's tokens in one chunk (null)
    assert result["itl_p50_ms"] is None or result["itl_p50_ms"] > 0
    # the server counted the same four requests, each to its length, and their tokens
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 4
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 20


def test_bench_serve_json_is_strict_where_figures_are_infinite_or_missing():
    from pagedllm.entrypoints.bench_serve import Result, _plain, summarize

    row = summarize(float("inf"), [Result(error="HTTP 400: bad")], 1.0)
    assert row["completed"] == 0 and row["errors"] == ["HTTP 400: bad"]
    text = json.dumps(_plain(row), allow_nan=False)  # raises on inf / nan
    back = json.loads(text)
    assert back["rate"] == "inf" and back["ttft_p50_ms"] is None


def test_bench_serve_says_when_no_server_answers(tmp_path):
    proc = run_cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1")
    assert proc.returncode == 2
    assert "error: no server answers at http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr

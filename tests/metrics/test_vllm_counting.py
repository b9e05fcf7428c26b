"""The engine's counters mean what vLLM's mean: prompt_tokens counts every prompt token
(cached or not), n > 1 looks the prompt up in the prefix cache once, an aborted request is a
finished request with finished_reason="abort" (in the latency histograms too), and the
InferenceMonitor's kv_cache_hit_rate is on /metrics next to the engine's counters."""

from __future__ import annotations

import httpx
import pytest

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread
from pagedllm.metrics.prometheus import PrometheusStatLogger

LABELS = {"model_name": "tiny", "engine": "0"}
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(66)]  # 66 token ids: 4 full 16-token blocks


@pytest.fixture()
def engine(tiny_llama):
    args = EngineArgs(
        model=str(tiny_llama),
        kv_cache_memory_bytes=1 << 22,
        max_model_len=256,
        block_size=16,
        enable_prefix_caching=True,
    )
    engine = LLMEngine.from_engine_args(args)
    metrics = PrometheusStatLogger("tiny", 256, process_metrics=False)
    engine.add_stat_logger(metrics)
    yield engine, metrics
    engine.shutdown()


def value(metrics: PrometheusStatLogger, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value("vllm:" + name, {**LABELS, **labels}) or 0.0


def run(engine: LLMEngine, request_id: str, params: SamplingParams) -> None:
    engine.add_request(request_id, PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()


def test_prompt_tokens_count_cached_ones_too(engine) -> None:
    engine, metrics = engine
    run(engine, "a", SamplingParams(max_tokens=2))
    run(engine, "b", SamplingParams(max_tokens=2))  # the same prompt: 64 tokens cached
    assert value(metrics, "prefix_cache_hits_total") == 64  # the second request hit the cache
    assert value(metrics, "prompt_tokens_total") == 2 * len(PROMPT)
    assert value(metrics, "request_prompt_tokens_sum") == 2 * len(PROMPT)


def test_n_samples_look_the_prompt_up_once(engine) -> None:
    engine, metrics = engine
    run(engine, "a", SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1))
    assert value(metrics, "prefix_cache_queries_total") == len(PROMPT)
    assert value(metrics, "prompt_tokens_total") == len(PROMPT)
    assert value(metrics, "generation_tokens_total") == 6  # both samples' tokens


def test_an_aborted_request_is_a_finished_abort(engine) -> None:
    engine, metrics = engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the prompt with its first token, then two more
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    engine.abort_request("a")
    engine.step()  # nothing to run; records the abort
    assert value(metrics, "request_success_total", finished_reason="abort") == 1
    assert value(metrics, "request_success_total", finished_reason="length") == 0
    for histogram in ("e2e_request_latency", "request_queue_time", "request_decode_time"):
        assert value(metrics, histogram + "_seconds_count") == 1, histogram
    assert value(metrics, "request_generation_tokens_sum") == 3
    engine.check_integrity()
    assert engine.block_manager.usage == 0.0


def test_kv_cache_hit_rate_is_on_metrics(tiny_llama) -> None:
    args = EngineArgs(
        model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=256, block_size=16
    )
    app = build_app(args, ["tiny"], log_stats_interval=None)
    with serve_in_thread(app) as url:
        text = httpx.get(url + "/metrics").text
        assert 'pagedllm:kv_cache_hit_rate{model_name="tiny"} 0.0' in text
        for _ in range(2):
            body = {"prompt": PROMPT, "max_tokens": 1}
            assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        registry = app.state.metrics.registry
        queries = registry.get_sample_value("vllm:prefix_cache_queries_total", LABELS)
        hits = registry.get_sample_value("vllm:prefix_cache_hits_total", LABELS)
        assert (queries, hits) == (2 * len(PROMPT), 64)
        rate = registry.get_sample_value("pagedllm:kv_cache_hit_rate", {"model_name": "tiny"})
        assert rate == pytest.approx(64 / (2 * len(PROMPT)))
        assert (
            f'pagedllm:kv_cache_hit_rate{{model_name="tiny"}} {rate}'
            in httpx.get(url + "/metrics").text
        )


def test_cache_config_info_tells_the_cpu_cache_as_it_was_sized(tiny_llama) -> None:
    """On the CPU the info gauge carries the blocks and bytes the engine allocated, under
    vLLM's metric name and labels, and no GPU memory share that nothing applied."""
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    app = build_app(args, ["tiny"], log_stats_interval=None)
    kv = app.state.engine.engine.kv_cache
    with serve_in_thread(app) as url:
        text = httpx.get(url + "/metrics").text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
    pairs = line[line.index("{") + 1 : line.index("}")].split(",")
    labels = {k: v.strip('"') for k, v in (pair.split("=", 1) for pair in pairs)}
    assert labels["engine"] == "0" and labels["model_name"] == "tiny"
    assert labels["device"] == "cpu" and labels["cache_dtype"] == "auto"
    assert labels["num_gpu_blocks"] == str(kv.num_blocks)
    assert int(labels["kv_cache_memory_bytes"]) == kv.num_blocks * kv.bytes_per_block
    assert 0 < int(labels["kv_cache_memory_bytes"]) <= 1 << 22
    assert "gpu_memory_utilization" not in labels
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{engine="0",model_name="tiny"}}' in text  # what llm-d's EPP reads

"""PrometheusStatLogger, LoggingStatLogger and InferenceMonitor on synthetic engine statistics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.core.stats import FinishedRequestStats, IterationStats, SchedulerStats
from pagedllm.metrics import InferenceMonitor, LoggingStatLogger, PrometheusStatLogger
from pagedllm.metrics.prometheus import token_buckets

LABELS = {"model_name": "m", "engine": "0"}
APP_LABELS = {"model_name": "m"}


def sched(queries: int = 0, hits: int = 0, preemptions: int = 0, **kw: float) -> SchedulerStats:
    base = dict(num_running=3, num_waiting=2, kv_cache_usage=0.25)
    base.update(kw)
    return SchedulerStats(
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=preemptions,
        **base,
    )


def finished(reason: str, prompt: int = 10, generated: int = 5) -> FinishedRequestStats:
    return FinishedRequestStats(reason, 1.5, 0.1, 0.2, 1.2, prompt, generated)


def test_prometheus_logger_maps_engine_stats() -> None:
    logger = PrometheusStatLogger("m", 512, {"block_size": "16"}, process_metrics=False)
    value = logger.registry.get_sample_value
    logger.record(
        sched(queries=100, hits=40, preemptions=1),
        IterationStats(
            0.0,
            num_prompt_tokens=30,
            num_generation_tokens=4,
            num_batched_tokens=34,
            time_to_first_tokens=[0.05, 0.07],
            inter_token_latencies=[0.01],
            finished_requests=[finished("stop"), finished("length", 20, 7)],
        ),
    )
    # Cumulative engine counters become increments: a second step adds only the difference.
    logger.record(sched(queries=150, hits=90, preemptions=1, num_running=0), IterationStats(1.0))
    assert value("vllm:num_requests_running", LABELS) == 0
    assert value("vllm:num_requests_waiting", LABELS) == 2
    assert value("vllm:kv_cache_usage_perc", LABELS) == 0.25
    assert value("vllm:prefix_cache_queries_total", LABELS) == 150
    assert value("vllm:prefix_cache_hits_total", LABELS) == 90
    assert value("vllm:num_preemptions_total", LABELS) == 1
    assert value("vllm:prompt_tokens_total", LABELS) == 30
    assert value("vllm:generation_tokens_total", LABELS) == 4
    for reason in ("stop", "length"):
        labels = {**LABELS, "finished_reason": reason}
        assert value("vllm:request_success_total", labels) == 1
    assert value("vllm:time_to_first_token_seconds_count", LABELS) == 2
    assert value("vllm:time_to_first_token_seconds_sum", LABELS) == pytest.approx(0.12)
    assert value("vllm:inter_token_latency_seconds_count", LABELS) == 1
    assert value("vllm:e2e_request_latency_seconds_sum", LABELS) == pytest.approx(3.0)
    assert value("vllm:request_queue_time_seconds_sum", LABELS) == pytest.approx(0.2)
    assert value("vllm:request_prefill_time_seconds_sum", LABELS) == pytest.approx(0.4)
    assert value("vllm:request_decode_time_seconds_sum", LABELS) == pytest.approx(2.4)
    assert value("vllm:request_inference_time_seconds_sum", LABELS) == pytest.approx(2.8)
    tpot = value("vllm:request_time_per_output_token_seconds_sum", LABELS)
    assert tpot == pytest.approx(1.2 / 4 + 1.2 / 6)  # decode time over tokens after the first
    assert value("vllm:request_prompt_tokens_sum", LABELS) == 30
    assert value("vllm:request_generation_tokens_sum", LABELS) == 12
    assert value("vllm:request_prompt_tokens_bucket", {**LABELS, "le": "10.0"}) == 1
    assert value("vllm:iteration_tokens_total_count", LABELS) == 1  # empty steps are skipped
    info = {**LABELS, "block_size": "16"}
    assert value("vllm:cache_config_info", info) == 1


def test_render_is_valid_exposition_with_every_metric_labelled() -> None:
    logger = PrometheusStatLogger("m", 256)
    logger.record(sched(), IterationStats(0.0, finished_requests=[finished("stop")]))
    families = list(text_string_to_metric_families(logger.render().decode()))
    ours = [f for f in families if f.name.startswith("vllm:")]
    assert len(ours) >= 19
    for family in ours:
        for sample in family.samples:
            assert sample.labels.get("model_name") == "m", sample
            assert sample.labels.get("engine") == "0", sample
    assert any(f.name.startswith("process_") for f in families)


def test_two_loggers_do_not_collide() -> None:
    a = PrometheusStatLogger("a", 64, process_metrics=False)
    b = PrometheusStatLogger("b", 64, process_metrics=False)
    a.record(sched(), IterationStats(0.0, num_generation_tokens=3))
    labels_b = {"model_name": "b", "engine": "0"}
    assert b.registry.get_sample_value("vllm:generation_tokens_total", labels_b) == 0


def test_token_buckets() -> None:
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1) == [1]


def test_logging_stat_logger_writes_one_line_per_interval() -> None:
    lines: list[str] = []
    now = [0.0]
    logger = LoggingStatLogger(interval=5.0, log=lines.append, clock=lambda: now[0])
    for _ in range(4):  # 4 steps over 4 s: no line yet
        now[0] += 1.0
        logger.record(
            sched(), IterationStats(now[0], num_prompt_tokens=5, num_generation_tokens=10)
        )
    assert lines == []
    now[0] = 5.0
    stats = sched(queries=200, hits=50, num_running=7, num_waiting=1, kv_cache_usage=0.5)
    logger.record(stats, IterationStats(5.0, num_generation_tokens=10))
    assert lines == [
        "prompt 4.0 tok/s, generation 10.0 tok/s, finished 0 reqs, running 7, waiting 1, "
        "KV cache 50.0%, prefix cache hit rate 25.0%"
    ]
    now[0] = 10.0  # the next window's hit rate counts only its own lookups
    logger.record(sched(queries=300, hits=150), IterationStats(10.0))
    assert lines[1].endswith("prefix cache hit rate 100.0%")
    assert lines[1].startswith("prompt 0.0 tok/s, generation 0.0 tok/s")


def test_inference_monitor() -> None:
    monitor = InferenceMonitor(labels={"model_name": "m"})
    monitor.record_metric("queue_depth", 3)
    monitor.record_metric("queue_depth", 5)
    monitor.observe("retrieval_seconds", 0.2)
    monitor.observe("retrieval_seconds", 0.4)
    monitor.increment("cache_misses", 2)
    value = monitor.registry.get_sample_value
    assert value("pagedllm:queue_depth", APP_LABELS) == 5
    assert value("pagedllm:retrieval_seconds_count", APP_LABELS) == 2
    assert value("pagedllm:retrieval_seconds_sum", APP_LABELS) == pytest.approx(0.6)
    assert value("pagedllm:cache_misses_total", APP_LABELS) == 2
    assert b"pagedllm:queue_depth" in monitor.render()
    with pytest.raises(ValueError, match="is a Gauge"):
        monitor.observe("queue_depth", 1.0)
    with pytest.raises(ValueError, match="must match"):
        monitor.record_metric("bad name", 1.0)

"""Speculative-decoding counters on /metrics (vLLM's names) and in the stats log line."""

from __future__ import annotations

from pagedllm.core.stats import IterationStats, SchedulerStats, SpecDecodingStats
from pagedllm.metrics import LoggingStatLogger, PrometheusStatLogger

LABELS = {"model_name": "m", "engine": "0"}


def sched() -> SchedulerStats:
    return SchedulerStats(1, 0, 0.5, 0, 0, 0)


def step_stats(*verifies: tuple[int, int]) -> IterationStats:
    spec = SpecDecodingStats()
    for num_drafts, num_accepted in verifies:
        spec.observe(num_drafts, num_accepted)
    return IterationStats(0.0, spec_decoding=spec)


def test_prometheus_spec_decode_counters() -> None:
    logger = PrometheusStatLogger("m", 512, process_metrics=False)
    logger.record(sched(), step_stats((4, 4), (4, 1)))
    logger.record(sched(), step_stats((3, 2)))
    logger.record(sched(), IterationStats(1.0))  # a step without speculation
    value = logger.registry.get_sample_value
    assert value("vllm:spec_decode_num_drafts_total", LABELS) == 3
    assert value("vllm:spec_decode_num_draft_tokens_total", LABELS) == 11
    assert value("vllm:spec_decode_num_accepted_tokens_total", LABELS) == 7
    per_pos = [
        value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**LABELS, "position": p})
        for p in "0123"
    ]
    assert per_pos == [3, 2, 1, 1]
    text = logger.render().decode()
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in text


def test_log_line_reports_acceptance_over_the_window() -> None:
    lines: list[str] = []
    now = [0.0]
    logger = LoggingStatLogger(interval=10.0, log=lines.append, clock=lambda: now[0])
    logger.record(sched(), step_stats((4, 4), (4, 0)))
    now[0] = 11.0
    logger.record(sched(), step_stats((4, 2)))
    # 6 of 12 draft tokens accepted over 3 verifies: mean length 1 + 6 / 3 = 3
    assert "acceptance rate 50.0%" in lines[-1]
    assert "mean acceptance length 3.00" in lines[-1]
    now[0] = 22.0
    logger.record(sched(), IterationStats(2.0))
    assert "acceptance" not in lines[-1]  # the window had no speculation


def test_engine_reports_its_speculation(model_factory) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        str(model_factory("llama")),
        dtype="float32",
        kv_cache_memory_bytes=1 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    logger = PrometheusStatLogger("m", 512, process_metrics=False)
    llm.llm_engine.add_stat_logger(logger)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    value = logger.registry.get_sample_value
    drafts = value("vllm:spec_decode_num_drafts_total", LABELS)
    draft_tokens = value("vllm:spec_decode_num_draft_tokens_total", LABELS)
    assert drafts > 0 and drafts <= draft_tokens <= 3 * drafts
    assert 0 <= value("vllm:spec_decode_num_accepted_tokens_total", LABELS) <= draft_tokens

"""Prometheus collectors of the engine under vLLM's names, labels and units.

Every engine collector is ``vllm:<name>`` with the labels ``model_name`` (the served name) and
``engine`` (the engine's index, "0" for a replica's one engine), as vLLM v1 exports them, so
vLLM's Grafana dashboards, llm-d's endpoint picker, the routers' load policies and
Prometheus-adapter rules written for vLLM read a pagedllm replica unchanged. Gauges of a share
are fractions (``kv_cache_usage_perc``: 1 means 100 %), times are in seconds, token counts in
tokens; counters get the ``_total`` suffix on the wire.

``PrometheusStatLogger.record`` is called by the engine after every step (on the engine thread;
prometheus_client is thread-safe). Cumulative engine counters (prefix-cache lookups,
preemptions) become Prometheus counters by adding the difference since the previous step.
Every collector lives in the logger's own registry, so several servers in one process (tests)
never collide; ``render()`` gives the text that /metrics serves.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from pagedllm.core.stats import IterationStats, SchedulerStats, SpecDecodingStats

PREFIX = "vllm:"
LABELS = ["model_name", "engine"]

# Bucket edges follow vLLM's, with finer low edges: a small model on a CPU answers in ms.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3]
ITL_BUCKETS += [0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0]
LATENCY_BUCKETS += [15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (the edges vLLM uses for token counts)."""
    edges: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return edges
            edges.append(float(value))
        scale *= 10


class PrometheusStatLogger:
    """Engine metrics as Prometheus collectors; pass to ``LLMEngine.add_stat_logger``."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: dict[str, str] | None = None,
        registry: CollectorRegistry | None = None,
        process_metrics: bool = True,
        engine_index: int = 0,
    ) -> None:
        self.model_name = model_name
        self.engine = str(engine_index)
        self.registry = registry if registry is not None else CollectorRegistry()
        if process_metrics:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        self._build_gauges(cache_info or {})
        self._build_counters()
        self._build_histograms(max_model_len)
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    # ---- collectors ----------------------------------------------------------------------
    def _labels(self, kind: type, name: str, doc: str, **kwargs: object) -> object:
        """The child of collector PREFIX + name for this model and engine."""
        collector = kind(PREFIX + name, doc, LABELS, registry=self.registry, **kwargs)
        return collector.labels(model_name=self.model_name, engine=self.engine)

    def _build_gauges(self, cache_info: dict[str, str]) -> None:
        g = self._labels
        self.num_running = g(
            Gauge, "num_requests_running", "Sequences in the running batch (n > 1 counts n)."
        )
        self.num_waiting = g(
            Gauge, "num_requests_waiting", "Sequences waiting to be scheduled, preempted included."
        )
        self.kv_cache_usage = g(Gauge, "kv_cache_usage_perc", "KV-cache usage; 1 means 100%.")
        info = Gauge(
            PREFIX + "cache_config_info",
            "Information of the KV-cache configuration.",
            [*LABELS, *sorted(cache_info)],
            registry=self.registry,
        )
        info.labels(model_name=self.model_name, engine=self.engine, **cache_info).set(1)

    def _build_counters(self) -> None:
        c = self._labels
        self.prefix_queries = c(
            Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = c(
            Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = c(Counter, "num_preemptions", "Preemptions of running sequences.")
        self.prompt_tokens = c(
            Counter, "prompt_tokens", "Prompt tokens of requests, cached or computed."
        )
        self.generation_tokens = c(Counter, "generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):  # exported as 0 before any request ends
            self._success(reason)
        self.spec_drafts = c(
            Counter, "spec_decode_num_drafts", "Speculative proposals verified (per sequence)."
        )
        self.spec_draft_tokens = c(
            Counter, "spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self.spec_accepted_tokens = c(
            Counter, "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by position in the proposal.",
            [*LABELS, "position"],
            registry=self.registry,
        )

    def _build_histograms(self, max_model_len: int) -> None:
        h = self._labels
        tokens = token_buckets(max_model_len)
        self.ttft = h(
            Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS
        )
        self.itl = h(
            Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=ITL_BUCKETS
        )
        self.tpot = h(
            Histogram,
            "request_time_per_output_token_seconds",
            "Decode time of a finished request over its tokens after the first.",
            buckets=ITL_BUCKETS,
        )
        latency = {
            "e2e": ("e2e_request_latency_seconds", "End-to-end request latency."),
            "queue": ("request_queue_time_seconds", "Time in the waiting queue."),
            "inference": ("request_inference_time_seconds", "First scheduled -> last token."),
            "prefill": ("request_prefill_time_seconds", "First scheduled -> first token."),
            "decode": ("request_decode_time_seconds", "First token -> last token."),
        }
        self.request_latency = {
            key: h(Histogram, name, doc, buckets=LATENCY_BUCKETS)
            for key, (name, doc) in latency.items()
        }
        self.request_prompt_tokens = h(
            Histogram,
            "request_prompt_tokens",
            "Prompt length of finished requests.",
            buckets=tokens,
        )
        self.request_generation_tokens = h(
            Histogram,
            "request_generation_tokens",
            "Generated tokens of finished requests (all n samples).",
            buckets=tokens,
        )
        self.iteration_tokens = h(  # vLLM's name carries the _total itself
            Histogram,
            "iteration_tokens_total",
            "Tokens computed per engine step.",
            buckets=ITERATION_TOKEN_BUCKETS,
        )

    # ---- the StatLogger protocol ---------------------------------------------------------
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, it = scheduler_stats, iteration_stats
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.prefix_queries.inc(max(0, s.prefix_cache_queries - self._last_queries))
        self.prefix_hits.inc(max(0, s.prefix_cache_hits - self._last_hits))
        self.preemptions.inc(max(0, s.num_preemptions - self._last_preemptions))
        self._last_queries = s.prefix_cache_queries
        self._last_hits = s.prefix_cache_hits
        self._last_preemptions = s.num_preemptions
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_batched_tokens:
            self.iteration_tokens.observe(it.num_batched_tokens)
        if it.spec_decoding is not None:
            self._record_spec_decoding(it.spec_decoding)
        for ttft in it.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        for req in it.finished_requests:
            self._success(req.finish_reason).inc()
            self.request_latency["e2e"].observe(req.e2e_latency)
            self.request_latency["queue"].observe(req.queue_time)
            self.request_latency["prefill"].observe(req.prefill_time)
            self.request_latency["inference"].observe(req.prefill_time + req.decode_time)
            self.request_latency["decode"].observe(req.decode_time)
            if req.num_generation_tokens > 1:
                self.tpot.observe(req.decode_time / (req.num_generation_tokens - 1))
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(
                model_name=self.model_name, engine=self.engine, position=str(pos)
            ).inc(count)

    def _success(self, reason: str) -> object:
        return self.request_success.labels(
            model_name=self.model_name, engine=self.engine, finished_reason=reason
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector in the registry."""
        return generate_latest(self.registry)

"""LoggingStatLogger: one line of engine statistics every few seconds while work is running."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedllm.core.stats import IterationStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger("pagedllm.stats")


class LoggingStatLogger:
    """Logs throughput, running/waiting, KV usage and prefix hit rate every ``interval`` s.

    A line is written from ``record`` (the engine calls it after each step), so an idle engine
    stays quiet; the last line after a burst shows it draining to zero.
    """

    def __init__(
        self,
        interval: float = 10.0,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self._log = log or logger.info
        self._clock = clock
        self._window_start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = 0
        self._last_queries = 0
        self._last_hits = 0
        self._spec = SpecDecodingStats()  # over the window

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens
        self._finished += len(iteration_stats.finished_requests)
        if iteration_stats.spec_decoding is not None:
            self._spec.merge(iteration_stats.spec_decoding)
        now = self._clock()
        if now - self._window_start >= self.interval:
            self._log(self.format_line(scheduler_stats, now - self._window_start))
            self._window_start = now
            self._prompt_tokens = self._generation_tokens = self._finished = 0
            self._spec = SpecDecodingStats()
            self._last_queries = scheduler_stats.prefix_cache_queries
            self._last_hits = scheduler_stats.prefix_cache_hits

    def format_line(self, s: SchedulerStats, elapsed: float) -> str:
        """The line for the current window (prefix hit rate: over the window's lookups)."""
        queries = s.prefix_cache_queries - self._last_queries
        hits = s.prefix_cache_hits - self._last_hits
        hit_rate = f"{100.0 * hits / queries:.1f}%" if queries else "n/a"
        elapsed = max(elapsed, 1e-9)
        return (
            f"prompt {self._prompt_tokens / elapsed:.1f} tok/s, "
            f"generation {self._generation_tokens / elapsed:.1f} tok/s, "
            f"finished {self._finished} reqs, "
            f"running {s.num_running}, waiting {s.num_waiting}, "
            f"KV cache {100.0 * s.kv_cache_usage:.1f}%, "
            f"prefix cache hit rate {hit_rate}"
        ) + self._spec_part()

    def _spec_part(self) -> str:
        """Acceptance over the window's verified drafts; mean acceptance length counts the
        token every verify step emits besides its accepted drafts (vLLM's definition)."""
        spec = self._spec
        if not spec.num_drafts:
            return ""
        rate = 100.0 * spec.num_accepted_tokens / max(spec.num_draft_tokens, 1)
        mean_len = 1.0 + spec.num_accepted_tokens / spec.num_drafts
        return (
            f", spec decode acceptance rate {rate:.1f}%, "
            f"mean acceptance length {mean_len:.2f} ({spec.num_drafts} drafts)"
        )

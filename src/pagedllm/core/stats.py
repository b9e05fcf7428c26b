"""Statistics the engine hands to its stat loggers after each step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SchedulerStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued, preempted ones included
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up, cumulative
    prefix_cache_hits: int  # of which found cached, cumulative
    num_preemptions: int  # cumulative


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # arrival -> finished, seconds
    queue_time: float  # arrival -> first scheduled
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class SpecDecodingStats:
    """Speculative decoding in one step (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # sequences that verified drafts
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [j]: at draft j

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for j, count in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[j] += count


@dataclass
class IterationStats:
    timestamp: float
    num_prompt_tokens: int = 0  # prompt tokens of requests whose first token came this step
    num_generation_tokens: int = 0  # tokens sampled in this step
    num_batched_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...

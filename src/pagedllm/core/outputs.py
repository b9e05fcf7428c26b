"""What the engine returns for a request, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> its logprob, for one position


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # everything generated so far (cumulative)
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of sampled tokens' logprobs, with logprobs on
    logprobs: list[TokenLogprobs] | None  # one entry per generated token, with logprobs on
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later DELTA output of the same sample: its text, tokens and logprobs;
        its running sums and finish replace this one's."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = field(default=None)  # set when finish_reason is "error"

    def add(self, later: RequestOutput) -> None:
        """Fold a later output of the same request, with output_kind DELTA, into this one:
        a consumer that fell a step behind reads the two as one delta."""
        mine = {c.index: c for c in self.outputs}
        for comp in later.outputs:
            prev = mine.get(comp.index)
            if prev is None:
                self.outputs.append(comp)
            else:
                prev.add(comp)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error

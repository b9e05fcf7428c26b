"""The state of one generated sequence, as the scheduler and block manager see it (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again after its blocks were taken (recompute)
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass
class SequenceTimings:
    """Wall-clock times (time.time()) of one sequence's life."""

    arrival: float  # when the request was added
    first_scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None  # when its first output token was sampled
    last_token: float | None = None  # when its latest output token was sampled
    finished: float | None = None  # when it finished, for any reason


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a prompt and what has been generated after it.

    Accounting: tokens [0, num_computed_tokens) have K/V in the cache; a step computes
    some of [num_computed_tokens, num_tokens). Prefill, chunked prefill, prefix-cache hits
    and decode differ only in these two numbers.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.time)
    prompt_leader: Sequence | None = None  # sibling whose prompt blocks this one reuses
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (-1: not looked up)
    block_table: list[int] = field(default_factory=list)
    # Models with several KV cache groups (global and sliding-window layers): the block
    # tables of groups 1.., indexed like block_table; empty for single-group models.
    group_block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks so far
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    lora_request: Any = None  # the LoRARequest it runs with (None: the base model)
    timings: SequenceTimings = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output, grown in place
        self.timings = SequenceTimings(arrival=self.arrival_time)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (keys the prefix cache)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def append_tokens(self, token_ids: list[int], max_model_len: int) -> SequenceStatus | None:
        """Append a step's tokens one by one, stopping at the first that ends the sequence
        (a speculative step may emit several; those after a stop are dropped)."""
        for token_id in token_ids:
            self.append_token(token_id)
            status = self.check_stop(max_model_len)
            if status is not None:
                return status
        return None

    def truncate_output(self, num_tokens: int) -> None:
        """Drop the last num_tokens output tokens (those after a stop string)."""
        if num_tokens > 0:
            del self.output_token_ids[-num_tokens:]
            del self.token_ids[-num_tokens:]

    def stop_token_ids(self) -> list[int]:
        """The tokens that end this sequence once min_tokens is reached (check_stop): its
        stop_token_ids, and EOS unless ignore_eos."""
        params = self.sampling_params
        stops = list(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            stops.append(self.eos_token_id)
        return stops

    def check_stop(self, max_model_len: int) -> SequenceStatus | None:
        """Token-level stop conditions after a new token (stop strings are the engine's)."""
        params = self.sampling_params
        num_out = self.num_output_tokens
        if num_out >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last == self.eos_token_id:
                return SequenceStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

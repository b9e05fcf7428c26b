"""Per-request bookkeeping of the engine: its sequences, their text and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from pagedllm.core.sequence import Sequence
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceOutputState:
    """Text and logprobs of one sequence as they accumulate."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    text: str = ""  # emitted text (stop strings already cut off)
    # what earlier outputs carried (output_kind DELTA): tokens, characters, logprob entries
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_logprobs: int = 0

    def check_stop_strings(self, delta: str) -> str | None:
        """Cut self.text at the first stop string that the newest delta completed; returns
        that stop string (None: no stop string completed)."""
        params = self.seq.sampling_params
        assert isinstance(params.stop, list)
        if not params.stop or not delta:
            return None
        for stop in params.stop:
            search_from = max(0, len(self.text) - len(delta) - len(stop) + 1)
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                return stop
        return None

    def visible_text(self) -> str:
        """Text safe to show while running: a possible partial stop string is held back."""
        hold = self.seq.sampling_params.output_text_buffer_length
        if hold and not self.seq.is_finished:
            return self.text[: max(0, len(self.text) - hold)]
        return self.text


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceOutputState]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: str | None = None
    prompt_logprobs_sent: bool = False  # an output carried them (DELTA sends them once)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        tokenizer: Any,
    ) -> RequestState:
        states = []
        for seq in seqs:
            detok = None
            if tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    tokenizer,
                    prompt_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
            want_lp = params.logprobs is not None
            states.append(
                SequenceOutputState(seq, detok, [] if want_lp else None, 0.0 if want_lp else None)
            )
        plp = [] if params.prompt_logprobs is not None else None
        return cls(
            request_id,
            prompt,
            prompt_ids,
            params,
            states,
            plp,
            RequestMetrics(seqs[0].arrival_time),
        )

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        """The request as its output_kind reports it: everything so far, or with DELTA what
        was added since the last output (the prompt logprobs with the first one only)."""
        delta = self.params.output_kind == RequestOutputKind.DELTA
        outputs = [self._completion(s, delta) for s in self.seqs]
        prompt_logprobs = self.prompt_logprobs
        if delta and self.prompt_logprobs_sent:
            prompt_logprobs = None
        self.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=max(self.seqs[0].seq.num_cached_tokens, 0),
            error=self.error,
        )

    @staticmethod
    def _completion(s: SequenceOutputState, delta: bool) -> CompletionOutput:
        text, tokens, logprobs = s.visible_text(), s.seq.output_token_ids, s.logprobs
        if delta:
            text, tokens = text[s.sent_chars :], tokens[s.sent_tokens :]
            logprobs = logprobs[s.sent_logprobs :] if logprobs is not None else None
            s.sent_chars += len(text)
            s.sent_tokens += len(tokens)
            s.sent_logprobs += len(logprobs or ())
        return CompletionOutput(
            index=s.seq.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=s.seq.status.finish_reason,
            stop_reason=s.seq.stop_reason,
        )

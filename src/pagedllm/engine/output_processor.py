"""The engine's output side: a step's new tokens turned into text, logprobs and
RequestOutputs; stop strings found in the text (vLLM v1's output processor).

It holds the state of every unfinished request. It ends sequences only through the
``finish`` it is given (the scheduler's), so the scheduler stays the one place where a
sequence ends and its blocks are freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.core.outputs import RequestOutput
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.core.stats import FinishedRequestStats, IterationStats, SpecDecodingStats
from pagedllm.engine.input_processor import ProcessedRequest
from pagedllm.engine.request_state import RequestState, SequenceOutputState
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.worker.model_runner import ModelOutput

# Scheduler.finish: ends a sequence (with a stop string as its stop_reason, if any).
FinishFn = Callable[..., None]


class OutputProcessor:
    def __init__(self, tokenizer: Any, finish: FinishFn, speculative: bool) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.speculative = speculative  # count accepted drafts per step
        self.requests: dict[str, RequestState] = {}

    def add_request(self, req: ProcessedRequest) -> None:
        self.requests[req.request_id] = RequestState.create(
            req.request_id, req.prompt, req.prompt_token_ids, req.params, req.seqs, self.tokenizer
        )

    def process(
        self,
        sched_out: SchedulerOutput,
        model_out: ModelOutput,
        updated: list[Sequence],
        num_before: dict[int, int],
        iteration: IterationStats,
    ) -> list[RequestOutput]:
        """The outputs of the requests that got tokens this step (num_before: seq_id -> its
        output length before the step); finished requests are forgotten here."""
        now = time.time()
        iteration.spec_decoding = self._spec_decoding_stats(sched_out, model_out)
        touched: dict[str, RequestState] = {}
        for item in sched_out.scheduled:
            self._add_prompt_logprobs(item.seq, item.num_new_tokens, model_out)
        for seq in updated:
            state = self.requests[seq.request_id]
            new_tokens = seq.output_token_ids[num_before[seq.seq_id] :]
            self._on_tokens(state, seq, new_tokens, model_out, now, iteration)
            touched[seq.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if finished or state.params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(state.to_output())
            if finished:
                iteration.finished_requests.append(self.finish_request(state, now))
        return results

    def _add_prompt_logprobs(self, seq: Sequence, num_new: int, model_out: ModelOutput) -> None:
        chunk = model_out.prompt_logprobs.get(seq.seq_id)
        state = self.requests.get(seq.request_id)
        if chunk is None or state is None or state.prompt_logprobs is None or seq.index != 0:
            return
        start = seq.num_computed_tokens - num_new  # entry i is for prompt token i
        if start == 0:
            state.prompt_logprobs[:] = chunk  # a recompute after preemption starts over
        elif len(state.prompt_logprobs) == start + 1:
            state.prompt_logprobs.extend(chunk)

    def _on_tokens(
        self,
        state: RequestState,
        seq: Sequence,
        new_tokens: list[int],
        model_out: ModelOutput,
        now: float,
        iteration: IterationStats,
    ) -> None:
        """Account for the step's new tokens of seq (several after accepted drafts)."""
        out_state = state.seqs[seq.index]
        if out_state.detokenizer is not None:
            new_tokens = self._detokenize(out_state, seq, new_tokens)
        t = seq.timings
        iteration.num_generation_tokens += len(new_tokens)
        if t.first_token is None:
            t.first_token = now
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                iteration.time_to_first_tokens.append(now - state.metrics.arrival_time)
                # Every prompt token, cached or computed, once per request (vLLM's meaning).
                iteration.num_prompt_tokens += len(state.prompt_token_ids)
        elif t.last_token is not None:
            # tokens that arrive together share the step's latency
            gap = (now - t.last_token) / len(new_tokens)
            iteration.inter_token_latencies.extend([gap] * len(new_tokens))
        t.last_token = now
        state.metrics.last_token_time = now
        lp = model_out.logprobs.get(seq.seq_id)
        if out_state.logprobs is not None and lp is not None:
            token = new_tokens[-1]  # requests with logprobs never speculate: one token
            out_state.logprobs.append(lp)
            out_state.cumulative_logprob = (out_state.cumulative_logprob or 0.0) + lp[token].logprob
        if seq.is_finished:
            t.finished = now

    def _detokenize(
        self, out_state: SequenceOutputState, seq: Sequence, tokens: list[int]
    ) -> list[int]:
        """Add tokens to the text one by one; a stop string ends the sequence there and drops
        the tokens after it (accepted drafts). Returns the tokens kept."""
        detok = out_state.detokenizer
        assert detok is not None
        for i, token in enumerate(tokens):
            # a token-level stop (EOS, stop ids, length) can only be the last token
            stopped_here = i == len(tokens) - 1 and seq.is_finished
            # A stop token (EOS or stop_token_ids) ends the text without appearing in it.
            hide = (
                stopped_here
                and seq.status == SequenceStatus.FINISHED_STOPPED
                and not seq.sampling_params.include_stop_str_in_output
            )
            delta = "" if hide else detok.add(token)
            if stopped_here:
                delta += detok.flush()
            out_state.text += delta
            stop = None if stopped_here else out_state.check_stop_strings(delta)
            if stop is not None:
                seq.truncate_output(len(tokens) - 1 - i)
                self.finish(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
                return tokens[: i + 1]
        return tokens

    def _spec_decoding_stats(
        self, sched_out: SchedulerOutput, model_out: ModelOutput
    ) -> SpecDecodingStats | None:
        if not self.speculative:
            return None
        stats = SpecDecodingStats()
        for item in sched_out.scheduled:
            tokens = model_out.sampled.get(item.seq.seq_id)
            if item.spec_token_ids and tokens:
                stats.observe(len(item.spec_token_ids), len(tokens) - 1)
        return stats

    def fail_request(self, request_id: str, message: str) -> RequestOutput:
        """The final output of a request whose sequences were ended with an error."""
        state = self.requests[request_id]
        state.error = message
        return state.to_output()

    def finish_request(self, state: RequestState, now: float) -> FinishedRequestStats:
        """Forget a finished request; its statistics for the stat loggers."""
        del self.requests[state.request_id]
        m = state.metrics
        m.finished_time = now
        m.first_scheduled_time = min(
            (s.seq.timings.first_scheduled for s in state.seqs if s.seq.timings.first_scheduled),
            default=None,
        )
        first_sched = m.first_scheduled_time or now
        first_token = m.first_token_time or now
        return FinishedRequestStats(
            finish_reason=state.seqs[0].seq.status.finish_reason or "stop",
            e2e_latency=now - m.arrival_time,
            queue_time=first_sched - m.arrival_time,
            prefill_time=first_token - first_sched,
            decode_time=(m.last_token_time or now) - first_token,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=sum(s.seq.num_output_tokens for s in state.seqs),
        )

"""LLMEngine: the vLLM-style offline engine. One step = schedule -> run model -> update."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.core.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
    StatLogger,
)
from pagedllm.engine.request_state import RequestState, SequenceOutputState
from pagedllm.engine.tokenizer import (
    encode_text,
    load_tokenizer,
    stop_token_ids_from_generation_config,
)
from pagedllm.generation_config import read_sampling_defaults
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.executor import ExecutorLostError, create_executor
from pagedllm.worker.model_runner import ModelOutput

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]

# Most samples one request may ask for (OpenAI's limit): n sequences are created at once.
MAX_N = 128
# Seeds seed .. seed + n - 1 go to torch.Generator.manual_seed, which takes 64-bit values.
SEED_RANGE = (-(2**63), 2**63 - 1)


class LLMEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        start = time.perf_counter()
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model.tokenizer)
        self.extra_stop_ids = stop_token_ids_from_generation_config(config.model.model)
        # request defaults from generation_config.json, as vLLM's --generation-config auto
        self.sampling_defaults = read_sampling_defaults(config.model.generation_config)
        self.executor = create_executor(config)
        self._in_flight: deque[tuple[SchedulerOutput, object, IterationStats]] = deque()
        self.kv_cache = self.executor.initialize_cache()  # the one record of the cache's layout
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks, self.kv_cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, RequestState] = {}
        self.stat_loggers: list[StatLogger] = []
        self.kv_event_publisher = None
        if config.kv_events is not None:  # a prefix-aware router follows the prefix cache
            from pagedllm.metrics.kv_events import publisher_for

            self.kv_event_publisher = publisher_for(config, self.block_manager)
            self.add_stat_logger(self.kv_event_publisher)
        self._aborted_stats: list[FinishedRequestStats] = []  # recorded by the next step
        stop_ids = {self.eos_token_id, *self.extra_stop_ids} - {None}
        # Masks are filled in a thread during the forward only where the forward leaves the
        # CPU free (CUDA); on the CPU the thread costs more than the fill (benchmarks/
        # results/structured.md), so the fill runs on the engine thread.
        self.structured = StructuredOutputManager(
            self.tokenizer,
            config.model.hf_config.vocab_size,
            sorted(stop_ids),
            overlap=config.device.device != "cpu",
        )
        self._seq_ids = itertools.count()
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "engine ready in %.2fs (weights %.2fs): %d KV blocks x %d tokens = %d token slots",
            self.startup_seconds,
            self.executor.load_seconds,
            self.kv_cache.num_blocks,
            self.kv_cache.block_size,
            self.kv_cache.num_slots,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), skip_tokenizer_init=skip_tokenizer_init)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (as vLLM's)."""
        return SamplingParams(**self.sampling_defaults)

    @property
    def model(self) -> Any:
        """The model (torch.nn.Module) in this process: rank 0's shard under tensor
        parallelism, the first tier of a split. Changing it in place changes what the engine
        runs, e.g. ``DynamicQuantConfig(...).apply(model=engine.model)`` quantizes it."""
        return self.executor.local_runner.model

    @property
    def eos_token_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises ValueError (naming the field) on bad input."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string.")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams.")
        self._check_params(params)
        grammar = self._compile_grammar(params)
        text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        arrival = arrival_time if arrival_time is not None else time.time()
        seqs = self._make_sequences(request_id, prompt_ids, params, arrival)
        if grammar is not None:
            self.structured.add(seqs, grammar)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState.create(
            request_id, text, prompt_ids, params, seqs, self.tokenizer
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids when the tokenizer is skipped.")
            return prompt, encode_text(self.tokenizer, prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}.")

    def _check_params(self, params: SamplingParams) -> None:
        """Limits that depend on the engine: a bad value here would fail a whole model step."""
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}.")
        lo, hi = SEED_RANGE
        if params.seed is not None and not lo <= params.seed <= hi - (params.n - 1):
            raise ValueError(f"seed must be a 64-bit integer (n={params.n}), got {params.seed}.")
        vocab = self.config.model.hf_config.vocab_size
        bad = [t for t in params.stop_token_ids if not t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab}).")

    def _compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled constraint of structured_outputs (None without one); ValueError."""
        if params.structured_outputs is None:
            return None
        if self.config.partition is not None:
            raise ValueError("structured_outputs is not supported with the edge/cloud split.")
        return self.structured.compile(params.structured_outputs)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty.")
        vocab = self.config.model.hf_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab}).")
        limit = self.config.scheduler.max_model_len
        if len(ids) > limit:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len ({limit})."
            )

    def _make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> list[Sequence]:
        extra = self.extra_stop_ids - {self.eos_token_id}
        if extra and not params.ignore_eos:
            params = copy.copy(params)  # the caller's object stays as it was
            params.stop_token_ids = sorted(set(params.stop_token_ids or []) | extra)
        seqs: list[Sequence] = []
        for index in range(params.n):
            child = params if params.n == 1 else params.clone_for_child(index)
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                index,
                prompt_ids,
                child,
                self.eos_token_id,
                arrival,
                prompt_leader=seqs[0] if seqs else None,
            )
            seqs.append(seq)
        return seqs

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        now = time.time()
        for rid in ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            for s in state.seqs:
                self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ABORTED)
            # Counted as vLLM counts it: request_success{finished_reason="abort"}, latencies.
            stats = self._on_finished(state, now)
            if self.stat_loggers:
                self._aborted_stats.append(stats)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, detokenize; returns updates."""
        if self.executor.repartition_pending and not self._in_flight:
            self._repartition()
        if self.executor.pipeline_depth > 1:
            return self._step_pipelined()
        sched_out = self.scheduler.schedule()
        iteration = IterationStats(time.time(), num_batched_tokens=sched_out.num_batched_tokens)
        iteration.finished_requests.extend(self._aborted_stats)
        self._aborted_stats.clear()
        if sched_out.is_empty:
            self._record(iteration)
            return []
        now = time.time()
        for item in sched_out.scheduled:
            t = item.seq.timings
            if t.first_scheduled is None:
                t.first_scheduled = now
        sched_out.grammar = self.structured.prepare(sched_out)  # filled during the forward
        try:
            model_out = self.executor.execute_model(sched_out)
        except ExecutorLostError as e:
            return self._lost(str(e), iteration)
        except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
            logger.exception("model step failed; failing the requests in it")
            failed = {item.seq.request_id for item in sched_out.scheduled}
            return self._fail_requests(failed, f"model step failed: {e}", iteration)
        return self._finish_step(sched_out, model_out, iteration)

    def _step_pipelined(self) -> list[RequestOutput]:
        """With an executor that keeps several steps in flight (a pipelined split): submit
        a micro-batch of the sequences not in flight, then finish the oldest step. Each
        micro-batch holds about 1/depth of the active sequences, so while one tier runs
        micro-batch i the one before it runs micro-batch i+1."""
        depth = self.executor.pipeline_depth
        held = frozenset(i.seq.seq_id for out, _, _ in self._in_flight for i in out.scheduled)
        active = len(self.scheduler.running) + len(self.scheduler.waiting)
        if self.executor.repartition_pending:  # drain: the layout changes once all are back
            sched_out = SchedulerOutput()
        else:
            sched_out = self.scheduler.schedule(held, max(1, -(-active // depth)))
        if not sched_out.is_empty:
            iteration = IterationStats(time.time(), num_batched_tokens=sched_out.num_batched_tokens)
            now = time.time()
            for item in sched_out.scheduled:
                if item.seq.timings.first_scheduled is None:
                    item.seq.timings.first_scheduled = now
            try:
                handle = self.executor.submit(sched_out)
            except ExecutorLostError as e:
                return self._lost(str(e), iteration)
            self._in_flight.append((sched_out, handle, iteration))
            if len(self._in_flight) < depth and len(held) + len(sched_out.scheduled) < active:
                return []  # filling the pipeline
        if not self._in_flight:
            return []
        sched_out, handle, iteration = self._in_flight.popleft()
        try:
            model_out = self.executor.collect(handle)
        except ExecutorLostError as e:
            return self._lost(str(e), iteration)
        # a sequence aborted while its step was in flight is already gone
        sched_out.scheduled = [i for i in sched_out.scheduled if not i.seq.is_finished]
        return self._finish_step(sched_out, model_out, iteration)

    def _repartition(self) -> None:
        """The executor changes how the model is laid out across processes (a split's cut
        moved): the running sequences' KV is laid out for the old layout, so they are
        preempted and recomputed, and the prefix cache forgets the blocks computed under it."""
        preempted = self.scheduler.preempt_all()
        self.block_manager.reset_prefix_cache()
        logger.info("repartitioning the model: %d running sequences will be recomputed", preempted)
        try:
            self.executor.repartition()
        except ExecutorLostError as e:  # the next step reconnects or fails what it runs
            logger.error("repartitioning lost the model's other part: %s", e)

    def _finish_step(
        self, sched_out: SchedulerOutput, model_out: ModelOutput, iteration: IterationStats
    ) -> list[RequestOutput]:
        """Apply a run step's tokens: the scheduler's update (accepted drafts, rollback,
        token-level stops), grammar ends, detokenization and stop strings, statistics."""
        num_before = {item.seq.seq_id: item.seq.num_output_tokens for item in sched_out.scheduled}
        updated = self.scheduler.update(sched_out, model_out.sampled, model_out.spec_token_ids)
        for seq in self.structured.advance(updated):  # the grammar ended (or was violated)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        iteration.spec_decoding = self._spec_decoding_stats(sched_out, model_out)
        outputs = self._process(sched_out, model_out, updated, num_before, iteration)
        self._record(iteration)
        return outputs

    def _process(
        self,
        sched_out: SchedulerOutput,
        model_out: ModelOutput,
        updated: list[Sequence],
        num_before: dict[int, int],
        iteration: IterationStats,
    ) -> list[RequestOutput]:
        now = time.time()
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
            results.append(state.to_output())
            if state.finished:
                iteration.finished_requests.append(self._on_finished(state, now))
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
            if not stopped_here and out_state.check_stop_strings(delta):
                seq.truncate_output(len(tokens) - 1 - i)
                if seq.is_finished:  # its last token also hit a token-level stop
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                return tokens[: i + 1]
        return tokens

    def _spec_decoding_stats(
        self, sched_out: SchedulerOutput, model_out: ModelOutput
    ) -> SpecDecodingStats | None:
        if self.config.speculative is None:
            return None
        stats = SpecDecodingStats()
        for item in sched_out.scheduled:
            tokens = model_out.sampled.get(item.seq.seq_id)
            if item.spec_token_ids and tokens:
                stats.observe(len(item.spec_token_ids), len(tokens) - 1)
        return stats

    def _lost(self, message: str, iteration: IterationStats) -> list[RequestOutput]:
        """The executor lost the KV state of the running sequences (and the steps in
        flight). If it can go on in another layout (a split running every layer locally
        after its link was lost), they are recomputed there; otherwise their requests fail."""
        self._in_flight.clear()
        if self.executor.repartition_pending:
            logger.warning("model execution lost its state (%s); recomputing instead", message)
            self._repartition()
            self._record(iteration)
            return []
        return self._fail_running(message, iteration)

    def _fail_running(self, message: str, iteration: IterationStats) -> list[RequestOutput]:
        """The executor lost the KV state of every running sequence: end their requests with
        finish_reason "error", free their blocks and forget the prefix cache built on them."""
        logger.error("model execution lost its state: %s", message)
        outputs = self._fail_requests(
            {s.request_id for s in self.scheduler.running}, message, iteration
        )
        self.block_manager.reset_prefix_cache()  # nothing holds blocks now
        return outputs

    def _fail_requests(
        self, request_ids: set[str], message: str, iteration: IterationStats
    ) -> list[RequestOutput]:
        """End these requests with finish_reason "error" and free their blocks."""
        now = time.time()
        results = []
        for request_id in request_ids:
            state = self.requests[request_id]
            state.error = message
            for s in state.seqs:
                self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ERROR)
            results.append(state.to_output())
            iteration.finished_requests.append(self._on_finished(state, now))
        self._record(iteration)
        return results

    def _on_finished(self, state: RequestState, now: float) -> FinishedRequestStats:
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

    def scheduler_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _record(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def check_integrity(self) -> None:
        """Assert the scheduler's and block manager's invariants (used by tests)."""
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.executor.shutdown()

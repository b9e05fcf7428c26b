"""LLMEngine: the vLLM-style offline engine. One step = schedule -> run model -> update.

A request goes through the input processor (checks, tokens, grammar, sequences) into the
scheduler; a step's tokens go through the scheduler's update (token-level stops) and the
output processor (text, logprobs, stop strings) into RequestOutputs. This file is the loop
between them and what happens when a step fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_cache import shared_window_left
from pagedllm.core.kv_groups import GroupedBlockManager
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.sequence import SequenceStatus
from pagedllm.core.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger
from pagedllm.engine.input_processor import MAX_N, InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.generation_config import read_sampling_defaults
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.executor import ExecutorLostError, create_executor
from pagedllm.worker.model_runner import ModelOutput

logger = logging.getLogger(__name__)

__all__ = ["MAX_N", "LLMEngine", "PromptType"]


def _releasable_window(config: EngineConfig) -> int | None:
    """The sliding window past which the block manager releases blocks: the model's, when
    all its layers have one, and no draft model shares the block tables (its own layers may
    read the whole sequence)."""
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        return None
    return shared_window_left(config.model.hf_config)


class LLMEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        start = time.perf_counter()
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model.tokenizer)
        # request defaults from generation_config.json, as vLLM's --generation-config auto
        self.sampling_defaults = read_sampling_defaults(config.model.generation_config)
        self.executor = create_executor(config)
        self._in_flight: deque[tuple[SchedulerOutput, object, IterationStats]] = deque()
        self.kv_cache = self.executor.initialize_cache()  # the one record of the cache's layout
        if self.kv_cache.extra_groups:  # global and sliding layers: a block pool each
            self.block_manager: BlockManager | GroupedBlockManager = GroupedBlockManager(
                self.kv_cache.groups, self.kv_cache.block_size, config.cache.enable_prefix_caching
            )
        else:
            self.block_manager = BlockManager(
                self.kv_cache.num_blocks,
                self.kv_cache.block_size,
                config.cache.enable_prefix_caching,
                window_left=_releasable_window(config),
            )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.stat_loggers: list[StatLogger] = []
        self.kv_event_publisher = None
        if config.kv_events is not None:  # a prefix-aware router follows the prefix cache
            from pagedllm.metrics.kv_events import publisher_for

            self.kv_event_publisher = publisher_for(config, self.block_manager)
            self.add_stat_logger(self.kv_event_publisher)
        self._aborted_stats: list[FinishedRequestStats] = []  # recorded by the next step
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.structured = self.input_processor.structured  # its masks are the loop's business
        self.output_processor = OutputProcessor(
            self.tokenizer, self.scheduler.finish, speculative=config.speculative is not None
        )
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

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests by id."""
        return self.output_processor.requests

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> None:
        """Queue a request; raises ValueError (naming the field) on bad input. lora_request
        (a LoRARequest) runs it with that adapter."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        req = self.input_processor.process(request_id, prompt, params, arrival_time, lora_request)
        if req.grammar is not None:
            self.structured.add(req.seqs, req.grammar)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.output_processor.add_request(req)

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
            stats = self.output_processor.finish_request(state, now)
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
        token-level stops), grammar ends, then the output processor (text, stop strings,
        logprobs, outputs), statistics."""
        num_before = {item.seq.seq_id: item.seq.num_output_tokens for item in sched_out.scheduled}
        updated = self.scheduler.update(sched_out, model_out.sampled, model_out.spec_token_ids)
        for seq in self.structured.advance(updated):  # the grammar ended (or was violated)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        outputs = self.output_processor.process(
            sched_out, model_out, updated, num_before, iteration
        )
        self._record(iteration)
        return outputs

    def _lost(self, message: str, iteration: IterationStats) -> list[RequestOutput]:
        """The executor lost the KV state of the running sequences (and the steps in
        flight). If it can go on in another layout (a split running every layer locally
        after its link was lost), they are recomputed there; otherwise their requests end
        with finish_reason "error" and the prefix cache forgets the blocks built on them."""
        self._in_flight.clear()
        if self.executor.repartition_pending:
            logger.warning("model execution lost its state (%s); recomputing instead", message)
            self._repartition()
            self._record(iteration)
            return []
        logger.error("model execution lost its state: %s", message)
        running = {s.request_id for s in self.scheduler.running}
        outputs = self._fail_requests(running, message, iteration)
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
            for s in state.seqs:
                self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ERROR)
            results.append(self.output_processor.fail_request(request_id, message))
            iteration.finished_requests.append(self.output_processor.finish_request(state, now))
        self._record(iteration)
        return results

    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def _record(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.scheduler.make_stats()
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

"""Continuous-batching scheduler with chunked prefill and preemption (torch-free).

Each step it first gives every running sequence the tokens it still needs (usually one:
decode), then admits waiting sequences FCFS, all within ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens. Long prompts are cut into chunks that fit the budget.
When a running sequence cannot get a block, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later, with
the tokens it has generated so far. No sequence is ever dropped or scheduled twice.

Speculative decoding: a decoding sequence that carries draft tokens (``spec_token_ids``) is
scheduled for 1 + k tokens, its own last token and the drafts, within the same budget and
block allocation. After the step only the accepted drafts keep their KV: ``num_computed_tokens``
moves back to them and the blocks past them are freed (see ``update``).

Lookahead slots (``num_lookahead_slots``: a draft model's own decodes, or the decode steps a
schedule runs with ``num_scheduler_steps``): a sampling sequence also gets blocks for that many
slots past its step, from free blocks only (no sequence is preempted for them); the runner
uses what it got, and ``update`` takes the several tokens such a step returns as it takes
accepted drafts.

Prompts that share a prefix nobody has computed yet (requests behind one system prompt,
arriving together): a waiting sequence whose first block missing from the prefix cache is one
that a running prefill is computing waits for it, skipped in the queue like an ``n > 1``
sibling, and finds the block cached a step later instead of computing it again (SGLang's
in-batch prefix caching). ``num_prefix_waits`` counts those skips.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_groups import GroupedBlockManager
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.core.stats import SchedulerStats

if TYPE_CHECKING:  # the config module may import torch (device detection); core never does
    from pagedllm.config import SchedulerConfig


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens on (drafts too)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified after the tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a token is sampled."""
        num_real = self.num_new_tokens - len(self.spec_token_ids)
        return self.seq.num_computed_tokens + num_real == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # in batch order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    preempted: list[Sequence] = field(default_factory=list)  # preempted during this step
    # Sequences finished since the last step the workers ran: they drop their state for them.
    finished_seq_ids: list[int] = field(default_factory=list)
    # The token mask of the constrained sequences that sample this step (the engine's
    # structured-output manager fills it while the model runs; rank 0's sampler applies it).
    grammar: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager | GroupedBlockManager
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # cumulative
        self._finished_ids: list[int] = []  # for the next non-empty SchedulerOutput
        self.num_prefill_chunks = 0  # cumulative: prompt pieces that stopped short of its end
        self.num_prefix_waits = 0  # cumulative: steps a sequence waited for a prefix in progress

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue seq; ValueError if it could outgrow the whole KV cache.

        A sequence that runs out of blocks while alone would preempt itself and be rescheduled
        forever, so one that may need more slots than the cache has is refused up front.
        """
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size
        max_tokens = seq.sampling_params.max_tokens
        longest = self.config.max_model_len
        if max_tokens is not None:
            longest = min(longest, seq.num_tokens + max_tokens)
        # The last token is sampled but never computed, so it takes no KV slot. With a
        # sliding window a sequence holds only the blocks its window and one step reach.
        step = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill:  # the prompt at once, then a token a step
            step = max(seq.num_tokens, 1 + self.config.num_lookahead_slots)
        if not bm.can_ever_hold(longest - 1, step):
            raise ValueError(
                f"a request of {seq.num_tokens} prompt tokens that may grow to {longest} tokens "
                f"can never fit the KV cache ({capacity} token slots); lower max_tokens, "
                "shorten the prompt or raise kv_cache_memory_bytes."
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: str | None = None) -> None:
        """End seq wherever it is and release its blocks. Every end of a sequence comes
        through here: token-level stops (``update``), a grammar's end, stop strings (with
        the string as ``stop_reason``), aborts and errors.

        A sequence that has ended already keeps its end, except for a stop string: it is
        found in the text after the step's tokens ended the sequence (at EOS, a stop token
        or a length limit), and the output has been cut back to it, so it is the end."""
        assert status.is_finished
        if seq.is_finished:
            if stop_reason is not None:
                seq.status, seq.stop_reason = status, stop_reason
            return
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = status
        seq.spec_token_ids = []
        self.block_manager.free(seq)
        self._finished_ids.append(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(
        self, hold: frozenset[int] = frozenset(), max_seqs: int | None = None
    ) -> SchedulerOutput:
        """The next step's batch. hold: ids of sequences in a step still in flight (a
        pipelined executor), neither scheduled nor preempted; max_seqs: at most this many
        sequences in the step (a pipelined executor's micro-batch)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        limit = max_seqs or self.config.max_num_seqs
        budget = self._schedule_running(out, budget, hold, limit)
        if not out.preempted:
            self._schedule_waiting(out, budget, limit)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if out.scheduled:  # an empty output is not run, so the ids wait for the next step
            out.finished_seq_ids, self._finished_ids = self._finished_ids, []
        self.num_prefill_chunks += sum(not s.samples for s in out.scheduled)
        now = time.time()
        for item in out.scheduled:
            if item.seq.timings.first_scheduled is None:
                item.seq.timings.first_scheduled = now
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, hold: frozenset[int], limit: int
    ) -> int:
        for seq in list(self.running):
            if budget <= 0 or len(out.scheduled) >= limit:
                break
            if seq.seq_id in hold or seq.status != SequenceStatus.RUNNING:
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = self._drafts_for(seq, num_new, budget)
            samples = seq.num_computed_tokens + num_new == seq.num_tokens
            extra = len(drafts) + (self.config.num_lookahead_slots if samples else 0)
            # Drafts and lookahead slots only get blocks that are free: no sequence is
            # preempted for a guess.
            if extra and not self.block_manager.allocate(seq, num_new + extra):
                drafts = []
            if not drafts and not self._allocate_or_preempt(seq, num_new, out, hold):
                break  # seq itself was preempted (and everything after it), or must wait
            out.scheduled.append(ScheduledSequence(seq, num_new + len(drafts), drafts))
            budget -= num_new + len(drafts)
        return budget

    def _drafts_for(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts seq verifies this step: only when the step reaches its end, and no more
        than the budget, max_model_len and max_tokens leave room for (accepted drafts and one
        more token are emitted)."""
        if not seq.spec_token_ids or seq.num_computed_tokens + num_new != seq.num_tokens:
            return []
        room = min(budget - num_new, self.config.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return seq.spec_token_ids[: max(room, 0)]

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, out: SchedulerOutput, hold: frozenset[int]
    ) -> bool:
        """Allocate for seq, preempting the newest running sequences (not held, not
        scheduled already) until it fits."""
        while not self.block_manager.allocate(seq, num_new):
            scheduled = {s.seq.seq_id for s in out.scheduled}
            victims = [
                s for s in self.running if s.seq_id not in hold and s.seq_id not in scheduled
            ]
            if not victims:
                return False  # only sequences in flight could make room: wait for them
            victim = victims[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, limit: int) -> None:
        bm = self.block_manager
        skipped: list[Sequence] = []
        in_progress: set[int] | None = None  # hashes of prompt blocks that prefills compute
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(out.scheduled) < limit
        ):
            seq = self.waiting[0]
            if self._waits_for_leader(seq) or self._lora_slots_full(seq):
                skipped.append(self.waiting.popleft())
                continue
            caching = self._may_use_cache(seq)
            cached = bm.find_cached_blocks(seq) if caching else []
            if caching and len(cached) < len(seq.block_hashes):
                if in_progress is None:
                    in_progress = self._prefix_blocks_in_progress()
                if seq.block_hashes[len(cached)] in in_progress:
                    self.num_prefix_waits += 1
                    skipped.append(self.waiting.popleft())
                    continue
            num_cached = len(cached) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            seq.num_computed_tokens = num_cached
            if not bm.allocate(seq, num_new, cached):
                seq.num_computed_tokens = 0
                break
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
                # n > 1: the prompt is looked up once, by the first sample (vLLM counts so).
                if caching and seq.prompt_leader is None:
                    bm.record_prefix_lookup(seq.num_tokens, num_cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            if in_progress is not None:
                in_progress.update(self._uncomputed_prompt_blocks(seq))
        self.waiting.extendleft(reversed(skipped))

    def _prefix_blocks_in_progress(self) -> set[int]:
        """Hashes of the full prompt blocks that running prefills have not computed yet
        (this step computes some of them; cache_full_blocks registers them after it)."""
        pending: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens and self._may_use_cache(seq):
                pending.update(self._uncomputed_prompt_blocks(seq))
        return pending

    def _uncomputed_prompt_blocks(self, seq: Sequence) -> list[int]:
        bs = self.block_manager.block_size
        self.block_manager.update_block_hashes(seq)
        return seq.block_hashes[seq.num_computed_tokens // bs : seq.num_prompt_tokens // bs]

    def _lora_slots_full(self, seq: Sequence) -> bool:
        """A sequence of an adapter not running yet waits while max_loras adapters run: every
        step's adapters must fit the runner's slots."""
        cap = self.config.max_loras
        if not cap or seq.lora_int_id == 0:
            return False
        running = {s.lora_int_id for s in self.running} - {0}
        return seq.lora_int_id not in running and len(running) >= cap

    def _may_use_cache(self, seq: Sequence) -> bool:
        # Prompt logprobs need logits at every prompt position, so nothing may be skipped.
        caching = self.block_manager.enable_prefix_caching
        return caching and seq.sampling_params.prompt_logprobs is None

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """n > 1: a sibling waits until the first sample has computed the shared prompt."""
        leader = seq.prompt_leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def preempt_all(self) -> int:
        """Preempt every running sequence (recompute later, in their current order): the
        KV they hold became unusable (the model's layout across processes changed)."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq)
        return len(victims)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the model ran -------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[int, list[int]],
        spec_token_ids: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Advance the scheduled sequences and append their new tokens (seq_id -> the step's
        tokens: one, the accepted drafts and one more, or a burst's); store the drafts
        proposed for the next step (seq_id -> draft tokens).

        Returns the sequences that got new tokens; those that hit a token-level stop
        condition are finished and their blocks released.
        """
        bm = self.block_manager
        proposals = spec_token_ids or {}
        updated: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            tokens = sampled.get(seq.seq_id)
            if tokens is None:  # a chunk of a prompt: nothing sampled yet
                seq.num_computed_tokens += item.num_new_tokens
                bm.cache_full_blocks(seq)
                bm.release_outside_window(seq)
                continue
            status = seq.append_tokens(tokens, self.config.max_model_len)
            # Every token but the newest now has its KV: the accepted drafts were computed at
            # the positions they hold. Rejected drafts' slots are rolled back (recomputed over
            # later), and blocks that only they reached are freed, never cached.
            seq.num_computed_tokens = seq.num_tokens - 1
            bm.trim(seq, seq.num_tokens)
            bm.cache_full_blocks(seq)
            bm.release_outside_window(seq)
            seq.spec_token_ids = proposals.get(seq.seq_id, [])
            updated.append(seq)
            if status is not None:
                self.finish(seq, status)
        return updated

    def make_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_integrity(self) -> None:
        live = list(self.running) + list(self.waiting)
        ids = [s.seq_id for s in live]
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        for seq in self.waiting:
            assert not seq.block_table, f"waiting sequence {seq.seq_id} holds blocks"
        self.block_manager.check_integrity(live)

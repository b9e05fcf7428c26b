"""Per-sequence grammar matchers and the token bitmask of each step's batch.

The engine asks `prepare` for the step's mask right after scheduling; the mask is filled in a
background thread while the model runs its forward pass, and the sampler waits for it only
when it applies the mask to the logits. A step without constrained sequences returns None
and costs nothing. After sampling, `advance` feeds each constrained sequence's new token to
its matcher.

Preemption needs no undo: a preempted sequence keeps its output tokens, and recompute only
rebuilds their KV entries before sampling the next token, which is where the matcher stands.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from pagedllm.structured_output.backend import Grammar, XGrammarBackend

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """The token mask of one step for the constrained rows of the sampled batch."""

    bitmask: torch.Tensor  # [num_sampled_rows, ceil(vocab / 32)] int32, all ones elsewhere
    rows: list[int]  # rows of the sampled batch that are constrained


@dataclass
class StructuredOutputStats:
    """Cumulative timings of mask work (seconds), to see what the overlap hides."""

    num_steps: int = 0  # steps that had at least one constrained sequence
    num_masks: int = 0  # row masks filled
    fill_seconds: float = 0.0  # time the fill thread spent filling masks
    wait_seconds: float = 0.0  # time the sampler waited for a fill still running
    # Time on the engine thread (the critical path): prepare, wait + apply, advance.
    engine_seconds: float = 0.0


class PendingBitmask:
    """A mask being filled in the background; `apply` waits for it (GrammarMask protocol)."""

    def __init__(self, future: Future[GrammarBitmask], stats: StructuredOutputStats) -> None:
        self._future = future
        self._stats = stats

    def result(self) -> GrammarBitmask:
        start = time.perf_counter()
        mask = self._future.result()
        self._stats.wait_seconds += time.perf_counter() - start
        return mask

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows of logits [num_sampled, vocab] -> -inf."""
        from pagedllm.structured_output.backend import apply_bitmask

        start = time.perf_counter()
        mask = self.result()
        apply_bitmask(logits, mask.bitmask, mask.rows)
        self._stats.engine_seconds += time.perf_counter() - start


class StructuredOutputManager:
    """Compiles constraints at request time and owns one matcher per constrained sequence."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], overlap: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._overlap = overlap
        self._backend: XGrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # compile() may come from a server thread
        self._grammars: dict[int, tuple[Sequence, Grammar]] = {}  # seq_id -> (seq, matcher)
        self.stats = StructuredOutputStats()

    @property
    def backend(self) -> XGrammarBackend:
        if self._backend is None:
            if self._tokenizer is None:
                raise ValueError("structured_outputs needs the tokenizer (skip_tokenizer_init).")
            try:
                from pagedllm.structured_output.backend import XGrammarBackend
            except ModuleNotFoundError as e:  # xgrammar is installed apart (README)
                raise RuntimeError(
                    f"structured outputs need xgrammar ({e}): "
                    "pip install --no-deps -c constraints.txt xgrammar"
                ) from e

            self._backend = XGrammarBackend(self._tokenizer, self._vocab_size, self._stop_token_ids)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a request; ValueError naming the problem."""
        with self._lock:
            return self.backend.compile(params)

    def add(self, seqs: list[Sequence], compiled: Any) -> None:
        """A matcher for each sequence of a request (n > 1: one per sample)."""
        for seq in seqs:
            self._grammars[seq.seq_id] = (seq, self.backend.matcher(compiled))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._grammars

    @property
    def num_active(self) -> int:
        return len(self._grammars)

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> PendingBitmask | None:
        """Start filling the step's mask; None when no sampled sequence is constrained.

        Rows follow the model runner's sampling order: the scheduled sequences that sample
        this step, in batch order.
        """
        if not self._grammars:
            return None
        start = time.perf_counter()
        try:
            return self._prepare(out)
        finally:
            self.stats.engine_seconds += time.perf_counter() - start

    def _prepare(self, out: SchedulerOutput) -> PendingBitmask | None:
        self._drop_finished()
        rows: list[int] = []
        grammars: list[Grammar] = []
        num_sampled = 0
        for item in out.scheduled:
            if not item.samples:
                continue
            entry = self._grammars.get(item.seq.seq_id)
            if entry is not None:
                rows.append(num_sampled)
                grammars.append(entry[1])
            num_sampled += 1
        if not rows:
            return None
        self.stats.num_steps += 1
        self.stats.num_masks += len(rows)
        if not self._overlap:
            done: Future[GrammarBitmask] = Future()
            done.set_result(self._fill(grammars, rows, num_sampled))
            return PendingBitmask(done, self.stats)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        future = self._pool.submit(self._fill, grammars, rows, num_sampled)
        return PendingBitmask(future, self.stats)

    def _fill(self, grammars: list[Grammar], rows: list[int], num_sampled: int) -> GrammarBitmask:
        start = time.perf_counter()
        bitmask = self.backend.allocate_bitmask(num_sampled)
        for grammar, row in zip(grammars, rows):
            grammar.fill(bitmask, row)
        self.stats.fill_seconds += time.perf_counter() - start
        return GrammarBitmask(bitmask, rows)

    def advance(self, seqs: list[Sequence]) -> list[Sequence]:
        """Feed each constrained sequence its newest token; returns the sequences whose
        grammar has terminated (or rejected the token) and that must finish now."""
        if not self._grammars:
            return []
        start = time.perf_counter()
        done: list[Sequence] = []
        for seq in seqs:
            entry = self._grammars.get(seq.seq_id)
            if entry is None:
                continue
            grammar = entry[1]
            token = seq.output_token_ids[-1]
            if not grammar.accept(token):
                logger.error(
                    "sequence %d sampled token %d that its grammar rejects", seq.seq_id, token
                )
                done.append(seq)
            elif grammar.is_terminated():
                done.append(seq)
        self.stats.engine_seconds += time.perf_counter() - start
        return done

    def release(self, seq_id: int) -> None:
        self._grammars.pop(seq_id, None)

    def _drop_finished(self) -> None:
        for seq_id in [i for i, (seq, _) in self._grammars.items() if seq.is_finished]:
            del self._grammars[seq_id]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

"""Embeddings from a decoder model: pooled final hidden states of a request's prompt.

The engine runs an embedding request as a one-token generation, batched and chunked by the
same scheduler as any other; the model runner hands each step's hidden states to the
``Pooler`` it holds (``ModelRunner.pooler``, set when serving with ``--runner pooling``),
which keeps, per expected request, the last prompt token's state (``last``) or the running
sum of all prompt tokens' states (``mean``). The server takes the vector once the request
has finished.

A recompute after preemption revisits positions already pooled; they are skipped. Mean
pooling needs every prompt position computed, so a prefix-cache hit (positions never
computed) makes the request fail with a clear error: serve mean pooling without prefix
caching.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.core.sequence import Sequence

POOLING_TYPES = ("last", "mean")


@dataclass
class _Pooled:
    next_position: int = 0  # prompt positions [0, next_position) have been pooled
    total: torch.Tensor | None = None  # mean: the sum of the states (float32)
    last: torch.Tensor | None = None  # the last prompt token's state
    error: str | None = None


class Pooler:
    def __init__(self, pooling_type: str = "last") -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}.")
        self.pooling_type = pooling_type
        self._pending: dict[str, _Pooled] = {}
        self._lock = threading.Lock()  # expect/take come from the server's thread

    def expect(self, request_id: str) -> None:
        with self._lock:
            self._pending[request_id] = _Pooled()

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def take(self, request_id: str) -> torch.Tensor:
        """The pooled vector of a finished request (float32, on the CPU)."""
        with self._lock:
            pooled = self._pending.pop(request_id)
        if pooled.error is not None:
            raise ValueError(pooled.error)
        if self.pooling_type == "mean":
            if pooled.total is None:
                raise ValueError("the request's prompt was never computed.")
            return pooled.total / pooled.next_position
        if pooled.last is None:
            raise ValueError("the request's last prompt token was never computed.")
        return pooled.last

    def observe(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """The step's final hidden states [num_tokens, hidden], rows in the order of
        ``out.scheduled`` (as the model runner lays out its batch)."""
        if not self._pending:
            return
        with self._lock:
            row = 0
            for item in out.scheduled:
                pooled = self._pending.get(item.seq.request_id)
                if pooled is not None:
                    self._add(pooled, item.seq, hidden[row : row + item.num_new_tokens])
                row += item.num_new_tokens

    def _add(self, pooled: _Pooled, seq: Sequence, states: torch.Tensor) -> None:
        start, end = seq.num_computed_tokens, seq.num_prompt_tokens
        count = min(states.shape[0], end - start)
        if count <= 0 or pooled.error is not None:
            return
        if self.pooling_type == "mean" and start > pooled.next_position:
            pooled.error = (
                "mean pooling needs every prompt token computed, but a prefix-cache hit "
                "skipped some: serve it with --no-enable-prefix-caching."
            )
            return
        skip = max(0, pooled.next_position - start)  # positions pooled before a recompute
        fresh = states[skip:count].float()
        if self.pooling_type == "mean" and fresh.shape[0]:
            part = fresh.sum(dim=0).cpu()
            pooled.total = part if pooled.total is None else pooled.total + part
        pooled.next_position = max(pooled.next_position, start + count)
        if start + count == end:
            pooled.last = states[count - 1].float().cpu()

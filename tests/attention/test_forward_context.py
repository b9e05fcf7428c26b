"""The per-forward attention context: set by a context manager, never nested, per thread."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext


def _metadata(num_tokens: int) -> AttentionMetadata:
    return AttentionMetadata.paged(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens),
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens],
    )


def test_context_is_set_inside_and_cleared_after():
    md = _metadata(3)
    with ForwardContext(md):
        assert ForwardContext.get() is md
    with pytest.raises(RuntimeError, match="outside a forward context"):
        ForwardContext.get()


def test_contexts_refuse_to_nest():
    with ForwardContext(_metadata(2)), pytest.raises(RuntimeError, match="do not nest"):
        with ForwardContext(_metadata(1)):
            pass


def test_two_threads_see_their_own_context():
    """Two engines stepping in two threads each read their own forward's metadata."""
    entered, release = threading.Barrier(2), threading.Event()
    seen: dict[int, int] = {}

    def run(num_tokens: int) -> None:
        with ForwardContext(_metadata(num_tokens)):
            entered.wait(timeout=10)  # both contexts are open at the same time
            release.wait(timeout=10)
            seen[num_tokens] = ForwardContext.get().num_tokens

    threads = [threading.Thread(target=run, args=(n,)) for n in (2, 5)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert seen == {2: 2, 5: 5}

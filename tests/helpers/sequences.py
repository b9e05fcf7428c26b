"""Sequences built by hand for the scheduler, block manager, sampler and runner tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import SamplingParams


def make_seq(
    seq_id: int,
    prompt: Iterable[int],
    output: Iterable[int] = (),
    eos_token_id: int | None = None,
    **params: Any,
) -> Sequence:
    """A sequence "r<seq_id>" with SamplingParams(**params), its output tokens appended."""
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), SamplingParams(**params), eos_token_id)
    for token in output:
        seq.append_token(token)
    return seq

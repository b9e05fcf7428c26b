"""How EngineArgs turns into the engine's configuration."""

from __future__ import annotations

import pytest

from pagedllm import EngineArgs


@pytest.mark.parametrize(
    ("budget", "seqs", "want_seqs"),
    [(32, 256, 32), (16, 4, 4), (None, 256, 256)],
)
def test_token_budget_below_max_num_seqs_caps_the_batch(tiny_llama, budget, seqs, want_seqs):
    """The token budget is kept as asked (prompts chunk); the batch shrinks to fit it."""
    args = EngineArgs(str(tiny_llama), max_num_batched_tokens=budget, max_num_seqs=seqs)
    config = args.create_engine_config().scheduler
    assert config.max_num_batched_tokens == (budget or 2048)
    assert config.max_num_seqs == want_seqs


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt(tiny_llama):
    args = EngineArgs(
        str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        args.create_engine_config()

"""Random prompts and greedy generation, checked for leaks after every run."""

from __future__ import annotations

import random
from typing import Any

from pagedllm import LLM, SamplingParams

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi token ids, none of them special (ids 0-2)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_params(max_tokens: int) -> SamplingParams:
    """Exactly max_tokens greedy tokens: EOS does not stop them."""
    return SamplingParams(max_tokens=max_tokens, **GREEDY)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of each prompt; then no block is left and invariants hold."""
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens), use_tqdm=False
    )
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.block_manager.usage == 0.0
    return [o.outputs[0].token_ids for o in outs]

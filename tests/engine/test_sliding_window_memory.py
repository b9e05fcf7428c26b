"""A Mistral-style model (every layer windowed) keeps only its window's KV blocks, and its
greedy output still matches transformers' full recompute: through chunked prefill,
preemption and prefix hits whose oldest blocks were released."""

from __future__ import annotations

from typing import Any

import torch
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy

from pagedllm import LLM

BLOCK = 4
WINDOW = 24  # the tiny Mistral's sliding_window (tests/helpers/models.py)
BLOCK_BYTES = 2048  # 2 layers x K,V x 4 slots x 2 kv heads x 16 dims x 4 bytes
CHUNK = 16


def hf_full_recompute(model_dir: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from transformers with no KV cache: every step runs the whole sequence,
    so its window mask, not any cache, decides what each position sees."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    return outs


class HeldBlocks:
    """After every step: the invariants hold, and the most real blocks one sequence held."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        self.most = 0

    def record(self, _scheduler_stats: Any, _iteration: Any) -> None:
        self.engine.check_integrity()
        null = self.engine.block_manager.null_block_id
        for seq in self.engine.scheduler.running:
            self.most = max(self.most, sum(b != null for b in seq.block_table))


def make_llm(model_dir: Any, num_blocks: int) -> tuple[LLM, HeldBlocks]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory_bytes=num_blocks * BLOCK_BYTES,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
    )
    held = HeldBlocks(llm)
    llm.llm_engine.add_stat_logger(held)
    return llm, held


def test_long_prompts_keep_the_window_blocks_and_match_hf(model_factory):
    model_dir = model_factory("mistral")
    prompts = random_prompts(4, 90, 110, seed=11)
    want = hf_full_recompute(model_dir, prompts, 30)
    assert want == hf_greedy(model_dir, prompts, 30)  # transformers' cached generate agrees
    # 20 blocks (80 slots; one is the null block): less than one 120-140-token sequence
    # needs without the window, so the requests fit only because blocks are released.
    llm, held = make_llm(model_dir, 20)
    bm, sched = llm.llm_engine.block_manager, llm.llm_engine.scheduler
    assert bm.window_left == WINDOW - 1 and bm.num_blocks == 19
    assert max(len(p) + 30 for p in prompts) > 19 * BLOCK
    assert greedy(llm, prompts, 30) == want
    # a step's keys reach a window back from its first token: ceil((23 + 16) / 4) + 1
    assert 0 < held.most <= -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1
    assert sched.num_preemptions > 0  # 4 sequences of up to 11 blocks share 19
    assert sched.num_prefill_chunks > 0
    # every sequence's blocks before its last window went back, preempted runs' again
    assert bm.num_released_blocks >= sum((len(p) + 29 - (WINDOW - 1)) // BLOCK for p in prompts)


def test_prefix_hits_on_released_blocks_match_hf(model_factory):
    model_dir = model_factory("mistral")
    prompts = random_prompts(3, 70, 90, seed=12)
    want = hf_greedy(model_dir, prompts, 12)
    llm, held = make_llm(model_dir, 256)
    bm = llm.llm_engine.block_manager
    assert greedy(llm, prompts, 12) == want
    released = bm.num_released_blocks
    assert released > 0
    hits = bm.prefix_cache_hits
    assert greedy(llm, prompts, 12) == want
    # every full block but the one with the last prompt token is hit, though all but the
    # window's last ones were released (they stayed cached in the free queue) and the new
    # table names the null block for them
    assert bm.prefix_cache_hits - hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert held.most <= -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1
    assert bm.num_released_blocks > released

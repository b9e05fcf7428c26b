"""Gemma 3 (global and sliding-window layers; the tiny random config of tests/helpers/models.py,
window 8, layers sliding / global / sliding) keeps a block pool per layer group: the sliding
layers' blocks past the window are released while the global layer's stay, and greedy output
still matches transformers' full recompute through chunked prefill, preemption and prefix
hits, with the invariants of both groups checked after every step."""

from __future__ import annotations

from typing import Any

from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy_recompute

from pagedllm import LLM
from pagedllm.core.kv_groups import GroupedBlockManager
from pagedllm.worker.cpu_decoder import CpuFusedDecoder

BLOCK = 4
WINDOW_LEFT = 7  # sliding_window 8
CHUNK = 16
MAX_LEN = 160
LAYER_BLOCK = 2 * BLOCK * 2 * 32 * 4  # one layer's K,V of a block: 4 slots x 2 heads x 32 x fp32
# a max-length sequence needs every block in the global group (1 layer), and in the sliding
# group (2 layers) only those a window and a step reach: ceil((7 + 16) / 4) + 1
GLOBAL_NEED = MAX_LEN // BLOCK
SLIDING_NEED = -(-(WINDOW_LEFT + CHUNK) // BLOCK) + 1
PER_SEQ = GLOBAL_NEED * LAYER_BLOCK + SLIDING_NEED * 2 * LAYER_BLOCK


class HeldBlocks:
    """After every step: every group's invariants hold; the most live blocks per group."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        self.most = [0, 0]

    def record(self, _scheduler_stats: Any, _iteration: Any) -> None:
        self.engine.check_integrity()
        bm = self.engine.block_manager
        for seq in self.engine.scheduler.running:
            for g, manager in enumerate(bm.groups):
                live = sum(b != manager.null_block_id for b in manager.table(seq))
                self.most[g] = max(self.most[g], live)


def make_llm(model_dir: Any, budget: int) -> tuple[LLM, HeldBlocks]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory_bytes=budget,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
    )
    held = HeldBlocks(llm)
    llm.llm_engine.add_stat_logger(held)
    return llm, held


def test_the_cache_has_a_pool_per_layer_group_sized_by_need(model_factory):
    llm, _ = make_llm(model_factory("gemma3"), 3 * PER_SEQ + 2 * LAYER_BLOCK)
    spec = llm.llm_engine.kv_cache
    (sliding,) = spec.extra_groups
    assert spec.group0_window is None and sliding.window_left == WINDOW_LEFT
    assert spec.bytes_per_block == LAYER_BLOCK and sliding.bytes_per_block == 2 * LAYER_BLOCK
    # three max-length sequences' worth in each group, plus the sliding group's null block
    assert spec.num_blocks == 3 * GLOBAL_NEED and sliding.num_blocks == 3 * SLIDING_NEED + 1
    assert isinstance(llm.llm_engine.block_manager, GroupedBlockManager)
    runner = llm.llm_engine.executor.local_runner
    assert runner.kv_cache_groups() == [[1], [0, 2]]
    assert [layer.kv_group for layer in runner.model.attention_layers()] == [1, 0, 1]
    # the fused CPU decoder serves it, one call per run of layers of one group
    assert isinstance(runner.fast_path, CpuFusedDecoder)
    assert [s.kv_group for s in runner.fast_path.segments] == [1, 0, 1]
    k0, _ = runner.kv_caches[0]
    k1, _ = runner.kv_caches[1]
    assert k0.shape[0] == sliding.num_blocks and k1.shape[0] == spec.num_blocks


def test_long_prompts_release_sliding_blocks_preempt_and_match_hf(model_factory):
    model_dir = model_factory("gemma3")
    prompts = random_prompts(4, 90, 110, seed=11)
    want = hf_greedy_recompute(model_dir, prompts, 30)
    # one and a half max-length sequences: four 120-140-token sequences must take turns.
    # A single pool for all three layers would hold only 27 blocks (108 slots) of this
    # budget, less than one of these sequences.
    budget = int(1.5 * PER_SEQ) + 2 * LAYER_BLOCK
    assert budget // (3 * LAYER_BLOCK) * BLOCK < min(len(p) for p in prompts) + 30
    llm, held = make_llm(model_dir, budget)
    engine = llm.llm_engine
    glob, sliding = engine.block_manager.groups
    assert greedy(llm, prompts, 30) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_prefill_chunks > 0
    assert glob.num_released_blocks == 0
    # every sequence's sliding blocks before its last window went back (preempted runs' again)
    assert sliding.num_released_blocks >= sum((len(p) + 29 - WINDOW_LEFT) // BLOCK for p in prompts)
    assert held.most[1] <= SLIDING_NEED
    assert held.most[0] >= (min(len(p) for p in prompts) + 29) // BLOCK


def test_prefix_hits_in_both_groups_match_hf(model_factory):
    model_dir = model_factory("gemma3")
    prompts = random_prompts(3, 70, 90, seed=12)
    want = hf_greedy_recompute(model_dir, prompts, 12)
    llm, held = make_llm(model_dir, 8 * PER_SEQ)
    bm = llm.llm_engine.block_manager
    assert greedy(llm, prompts, 12) == want
    released = bm.groups[1].num_released_blocks
    assert released > 0
    hits = bm.prefix_cache_hits
    assert greedy(llm, prompts, 12) == want
    # every full block but the one with the last prompt token is hit: the global group's
    # from its cache, the sliding group's recent ones from its free queue (null before them)
    assert bm.prefix_cache_hits - hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert bm.groups[1].num_released_blocks > released
    assert held.most[1] <= SLIDING_NEED

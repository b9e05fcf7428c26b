"""Speculative decoding keeps greedy output identical to plain decoding, token for token,
through chunked prefill, prefix-cache hits and preemption, on every architecture."""

from __future__ import annotations

import random

import pytest
from conftest import ARCH_CONFIGS

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.stats import IterationStats, SchedulerStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
VOCAB = 320


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    tails = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    return [shared + t for t in tails]


class SpecCounter:
    """A stat logger that sums the spec-decode counters."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, _: SchedulerStats, it: IterationStats) -> None:
        if it.spec_decoding is not None:
            self.drafts += it.spec_decoding.num_drafts
            self.draft_tokens += it.spec_decoding.num_draft_tokens
            self.accepted += it.spec_decoding.num_accepted_tokens


class OracleProposer:
    """Proposes the known greedy continuation with every third draft position wrong, so that
    steps accept some drafts and reject the rest at varying offsets."""

    def __init__(self, continuations: list[list[int]], k: int) -> None:
        self.continuations = continuations
        self.k = k

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        n = len(token_ids)
        for full in self.continuations:
            if full[:n] == token_ids:
                drafts = full[n : n + self.k]
                return [(t + 1) % VOCAB if (n + j) % 3 == 2 else t for j, t in enumerate(drafts)]
        return []


def make_llm(model_dir, spec: dict | None, **kwargs) -> LLM:
    args = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
    args.update(kwargs)
    return LLM(str(model_dir), speculative_config=spec, **args)


def count_chunks(llm: LLM) -> list[int]:
    """Counts steps that computed part of a prompt but not its end (chunked prefill)."""
    scheduler: Scheduler = llm.llm_engine.scheduler
    chunks = [0]
    schedule = scheduler.schedule

    def counting():  # noqa: ANN202
        out = schedule()
        for item in out.scheduled:
            seq = item.seq
            if 0 < seq.num_prompt_tokens - seq.num_computed_tokens > item.num_new_tokens:
                chunks[0] += 1
        return out

    scheduler.schedule = counting  # type: ignore[method-assign]
    return chunks


def generate_twice(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Two rounds: the second finds the first one's blocks in the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for _ in range(2):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.block_manager.usage == 0.0
    return outs


# 2 layers x K,V x 4 slots x 2 heads x 16 dims x 4 bytes = 2 KiB per block: 24 blocks hold
# 96 tokens, fewer than 4 running sequences need together (up to ~300), so some are preempted.
REGIMES = dict(max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory_bytes=24 * 2048)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_identical_with_rollbacks(model_factory, arch: str) -> None:
    model_dir = model_factory(arch)
    prompts = prompts_with_shared_prefix(seed=11)
    max_tokens = 24
    plain = generate_twice(make_llm(model_dir, None, **REGIMES), prompts, max_tokens)

    llm = make_llm(model_dir, NGRAM, **REGIMES)
    runner = llm.llm_engine.executor.runner
    full = [p + out for p, out in zip(prompts, plain)]
    runner.speculator.proposer = OracleProposer(full, k=4)
    runner.speculator.gate.min_accepted = 0.0  # verify every proposal
    counter = SpecCounter()
    llm.llm_engine.add_stat_logger(counter)
    chunks = count_chunks(llm)
    got = generate_twice(llm, prompts, max_tokens)

    assert got == plain
    engine = llm.llm_engine
    assert chunks[0] > 0
    assert engine.block_manager.prefix_cache_hits >= 5 * 24
    assert engine.scheduler.num_preemptions > 0
    assert counter.accepted > 100
    assert counter.accepted < counter.draft_tokens  # rejections happened too


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_ngram_greedy_identical(model_factory, arch: str) -> None:
    """The real prompt-lookup proposer; a random model copies only by chance, so proposals are
    accepted far less often, but some are."""
    model_dir = model_factory(arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 12) for _ in range(30)] for _ in range(4)]  # repetitive
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    plain = make_llm(model_dir, None).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model_dir, NGRAM)
    counter = SpecCounter()
    llm.llm_engine.add_stat_logger(counter)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    llm.llm_engine.check_integrity()
    assert counter.drafts > 0 and counter.accepted > 0

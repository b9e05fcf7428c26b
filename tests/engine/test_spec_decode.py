"""Speculative decoding keeps greedy output identical to plain decoding, token for token,
through chunked prefill, prefix-cache hits and preemption, on every architecture."""

from __future__ import annotations

import random

import pytest
from helpers.models import ARCH_CONFIGS

from pagedllm import LLM, SamplingParams
from pagedllm.config import kv_bytes_per_token, load_hf_config
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
    """Proposes the known greedy continuation with every wrong_every-th position wrong (0:
    none), so that steps accept some drafts and reject the rest at varying offsets."""

    def __init__(self, continuations: list[list[int]], k: int, wrong_every: int) -> None:
        self.continuations = continuations
        self.k = k
        self.wrong_every = wrong_every

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        n = len(token_ids)
        for full in self.continuations:
            if full[:n] == token_ids:
                drafts = full[n : n + self.k]
                if not self.wrong_every:
                    return drafts
                w = self.wrong_every
                return [
                    (t + 1) % VOCAB if (n + j) % w == w - 1 else t for j, t in enumerate(drafts)
                ]
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


# 2 layers x K,V x 4 slots x 2 heads x 16 dims x 4 bytes = 2 KiB per block: 24 blocks hold
# 96 tokens, fewer than 4 running sequences need together (up to ~300), so some are preempted.
REGIMES = dict(max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory_bytes=24 * 2048)


def with_oracle(llm: LLM, continuations: list[list[int]], wrong_every: int = 3) -> SpecCounter:
    speculator = llm.llm_engine.executor.runner.speculator
    speculator.ngram = OracleProposer(continuations, k=4, wrong_every=wrong_every)
    speculator.gate.min_accepted = 0.0  # verify every proposal
    counter = SpecCounter()
    llm.llm_engine.add_stat_logger(counter)
    return counter


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_identical_with_rollbacks(model_factory, arch: str) -> None:
    model_dir = model_factory(arch)
    prompts = prompts_with_shared_prefix(seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 24 blocks of this architecture's KV (Qwen3's and Gemma 3's blocks are larger); 14 for
    # Mistral, whose blocks past the window are released (fewer blocks to preempt)
    per_token = kv_bytes_per_token(load_hf_config(str(model_dir)), elem_bytes=4)
    blocks = 14 if arch == "mistral" else 24
    regimes = dict(REGIMES, kv_cache_memory_bytes=blocks * 4 * per_token)
    plain_llm = make_llm(model_dir, None, **regimes)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]

    llm = make_llm(model_dir, NGRAM, **regimes)
    counter = with_oracle(llm, [p + out for p, out in zip(prompts, plain)])
    chunks = count_chunks(llm)
    got = []
    for _ in range(2):  # the second round finds the first one's blocks in the prefix cache
        got.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.block_manager.usage == 0.0

    assert got == [plain, plain]
    engine = llm.llm_engine
    assert chunks[0] > 0
    assert engine.block_manager.prefix_cache_hits >= len(prompts) * 24
    assert engine.scheduler.num_preemptions > 0
    assert counter.accepted > 50
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


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def stop_setup(model_factory):
    """A llama model, its plain greedy continuations, and an engine whose drafts are always
    right, so that each step after the first accepts all 4 drafts."""
    model_dir = model_factory("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(3)]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain_llm = make_llm(model_dir, None)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, long, use_tqdm=False)]
    spec_llm = make_llm(model_dir, NGRAM)
    counter = with_oracle(spec_llm, [p + out for p, out in zip(prompts, plain)], wrong_every=0)
    return plain_llm, spec_llm, counter, prompts, plain


def test_max_tokens_inside_an_accepted_run(stop_setup) -> None:
    plain_llm, spec_llm, counter, prompts, _ = stop_setup
    for max_tokens in (3, 7, 8):  # 1 + 5 + ...: the limit falls inside a run of drafts
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        got = outputs(spec_llm, prompts, params)
        assert got == outputs(plain_llm, prompts, params)
        assert all(len(tokens) == max_tokens for tokens, *_ in got)
    assert counter.accepted > 0


def test_stop_token_inside_an_accepted_run(stop_setup) -> None:
    plain_llm, spec_llm, counter, prompts, plain = stop_setup
    before = counter.accepted
    for position in (3, 4, 9):
        stop_id = plain[0][position]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id])
        got = outputs(spec_llm, prompts, params)
        assert got == outputs(plain_llm, prompts, params)
        first_stop = plain[0].index(stop_id)
        assert got[0][0] == plain[0][: first_stop + 1] and got[0][2] == "stop"
    assert counter.accepted > before


def test_stop_string_inside_an_accepted_run(stop_setup) -> None:
    plain_llm, spec_llm, counter, prompts, _ = stop_setup
    before = counter.accepted
    full = outputs(plain_llm, prompts, SamplingParams(temperature=0.0, max_tokens=40))
    text = full[0][1]
    stops = 0
    for start in (len(text) // 4, len(text) // 2):
        stop = text[start : start + 3]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
        got = outputs(spec_llm, prompts, params)
        assert got == outputs(plain_llm, prompts, params)
        stops += got[0][2] == "stop" and got[0][3] == stop
    assert stops == 2
    assert counter.accepted > before


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_draft_model_greedy_identical(model_factory, arch: str) -> None:
    """The target as its own draft: every greedy draft is accepted. A different, smaller
    draft: most are rejected. Both give the plain output, through chunked prefill, prefix
    hits and preemption (the draft's cache shares the target's blocks)."""
    model_dir = model_factory(arch)
    small = model_factory(arch, seed=1, num_hidden_layers=1)
    prompts = prompts_with_shared_prefix(seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    regimes = dict(REGIMES, kv_cache_memory_bytes=48 * 2048)  # two caches share the blocks
    plain = [
        o.outputs[0].token_ids
        for o in make_llm(model_dir, None, **REGIMES).generate(prompts, params, use_tqdm=False)
    ]
    for draft, all_accepted, rounds in ((model_dir, True, 2), (small, False, 2)):
        llm = make_llm(model_dir, {"model": str(draft), "num_speculative_tokens": 3}, **regimes)
        counter = SpecCounter()
        llm.llm_engine.add_stat_logger(counter)
        for _ in range(rounds):  # a second round finds the first one's prompt blocks cached
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert got == plain
            llm.llm_engine.check_integrity()
        engine = llm.llm_engine
        assert engine.block_manager.prefix_cache_hits >= (rounds - 1) * len(prompts) * 24
        assert engine.scheduler.num_prefill_chunks > 0
        assert engine.scheduler.num_preemptions > 0
        assert counter.draft_tokens > 0
        assert (counter.accepted == counter.draft_tokens) == all_accepted


def test_draft_equal_to_target_accepts_sampled_drafts(model_factory) -> None:
    """With q == p (the target as draft, the same temperature / top-k / top-p), speculative
    sampling accepts every draft: the draft distribution is built as the target's is."""
    model_dir = model_factory("qwen2")
    llm = make_llm(model_dir, {"model": str(model_dir), "num_speculative_tokens": 3})
    counter = SpecCounter()
    llm.llm_engine.add_stat_logger(counter)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(10)] for _ in range(3)]
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5, max_tokens=24)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert counter.draft_tokens > 20
    assert counter.accepted >= 0.95 * counter.draft_tokens

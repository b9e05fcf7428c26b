"""The bundled demo model is the default model, and pagedllm's greedy output equals HF's on it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers.oracle import hf_greedy
from helpers.tools import load_tool

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="demo model absent")


def test_demo_model_is_the_default():
    assert Path(EngineArgs().model).resolve() == DEMO


def test_greedy_matches_hf_on_the_demo_model():
    llm = LLM(str(DEMO), dtype="float32", kv_cache_memory_bytes=64 << 20)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The list type", "A dictionary is", "def ")]
    # min_tokens masks EOS as the oracle's min_new_tokens does (ignore_eos would let the
    # model pick EOS as a token)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(DEMO, prompts, 24)
    text = (
        llm.generate(
            ["The list type"], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert len(text.split()) >= 3  # it writes words, not noise


def _loops(ids: list[int], n: int = 8, times: int = 3) -> bool:
    """Whether some run of n tokens occurs `times` times: a generation caught in a loop."""
    counts = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return max(counts.values(), default=0) >= times


def test_default_sampling_reads_like_text_not_a_loop():
    """With no sampling given, generation_config.json's defaults apply (as in vLLM): a first
    try does not loop the way greedy decoding of a model this small can."""
    assert _loops([5, 6, 7, 8, 9, 10, 11, 12] * 3) and not _loops(list(range(64)))
    llm = LLM(str(DEMO), kv_cache_memory_bytes=64 << 20)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature > 0 and defaults.repetition_penalty > 1.0
    prompts = ["The list type", "A dictionary is", "The with statement", "Return a new", "def "]
    for seed, prompt in enumerate(prompts):
        params = llm.get_default_sampling_params()
        params.seed, params.max_tokens, params.ignore_eos = seed, 64, True
        ids = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert not _loops(ids), prompt


def test_demo_model_scores_what_its_model_card_records():
    """pagedllm's prompt logprobs over the pinned held-out documentation pages give the
    bits per byte and top-1 accuracy that tools/eval_demo_model.py (transformers) recorded in
    eval.json for the shipped weights: the weights are the ones described, and the engine
    scores them as transformers does."""
    import json
    import math
    import platform

    record = json.loads((DEMO / "eval.json").read_text())["pinned"]
    if platform.python_version() != record["python"]:
        pytest.skip(f"the corpus is Python {record['python']}'s standard library")
    evaluate = load_tool("eval_demo_model")
    train = load_tool("train_demo_model")
    _, heldout = train.split_corpus(train.build_corpus())
    pages = evaluate.pinned_pages(heldout, record["pages"])
    llm = LLM(str(DEMO), dtype="float32", kv_cache_memory_bytes=64 << 20)
    tok = llm.get_tokenizer()
    nats, hits, tokens, nbytes = 0.0, 0, 0, 0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    for page in pages:
        ids = [tok.bos_token_id, *tok.encode(page, add_special_tokens=False), tok.eos_token_id]
        for window in evaluate._windows(ids, 512):
            out = llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)[0]
            for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
                nats -= entry[token].logprob
                hits += entry[token].rank == 1
                tokens += 1
        nbytes += len(page.encode("utf-8"))
    assert tokens == record["tokens"]
    assert nats / math.log(2) / nbytes == pytest.approx(record["bits_per_byte"], rel=1e-4)
    assert hits / tokens == pytest.approx(record["top1_accuracy"], abs=2 / tokens)

"""The bundled demo model is the default model, and pagedllm's greedy output equals HF's on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.oracle import hf_greedy

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
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
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


def _repeated_trigram_share(ids: list[int]) -> float:
    """Share of the token trigrams that already occurred earlier in the sequence."""
    grams = [tuple(ids[i : i + 3]) for i in range(len(ids) - 2)]
    return 1.0 - len(set(grams)) / len(grams)


def test_default_sampling_reads_like_text_not_a_loop():
    """With no sampling given, generation_config.json's defaults apply (as in vLLM): a first
    try does not repeat itself the way greedy decoding of a model this small does."""
    llm = LLM(str(DEMO), kv_cache_memory_bytes=64 << 20)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature > 0 and defaults.repetition_penalty > 1.0
    prompts = ["The list type", "A dictionary is", "The with statement"]
    sampled = []
    for seed, prompt in enumerate(prompts):
        params = llm.get_default_sampling_params()
        params.seed, params.max_tokens, params.ignore_eos = seed, 64, True
        sampled.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert max(_repeated_trigram_share(ids) for ids in sampled) < 0.2

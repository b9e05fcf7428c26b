"""Greedy outputs compared the way vLLM's check_logprobs_close does.

Two implementations of one quantized model differ in the last bits of every logit, so their
greedy sequences may part where two tokens are nearly tied. The criterion: the sequences are
equal, or at the first position where they differ each side's token is among the other
side's top-k there (a near tie, not a bug); after that position nothing is compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedyOutput:
    token_ids: list[int]
    top: list[set[int]]  # the top-k token ids at each generated position


def check_logprobs_close(a: GreedyOutput, b: GreedyOutput, names: tuple[str, str]) -> int:
    """AssertionError unless a and b agree under the criterion; returns how many tokens
    match before the first difference (the whole length when equal)."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x == y:
            continue
        assert x in b.top[i], f"position {i}: {names[0]} chose {x}, not in {names[1]}'s top-k"
        assert y in a.top[i], f"position {i}: {names[1]} chose {y}, not in {names[0]}'s top-k"
        return i
    assert len(a.token_ids) == len(b.token_ids), "the outputs differ in length"
    return len(a.token_ids)


def pagedllm_greedy(llm, prompt_ids: list[int], max_tokens: int, k: int = 5) -> GreedyOutput:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    return GreedyOutput(list(out.token_ids), [set(step) for step in out.logprobs])


def hf_greedy_top(model, prompt_ids: list[int], max_tokens: int, k: int = 5) -> GreedyOutput:
    """transformers' greedy tokens and each step's top-k, exactly max_tokens of them."""
    ids = torch.tensor([prompt_ids])
    gen = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        repetition_penalty=1.0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id,
    )
    top = [set(step[0].topk(k).indices.tolist()) for step in gen.logits]
    return GreedyOutput(gen.sequences[0, len(prompt_ids) :].tolist(), top)

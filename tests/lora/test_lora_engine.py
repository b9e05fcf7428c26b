"""Multi-LoRA in the engine: base model and two adapters in one batch, checked token for
token against transformers + peft, with the prefix cache kept apart per adapter."""

from __future__ import annotations

import pytest
from helpers.generation import greedy_params, random_prompts
from helpers.lora import ALL, ATTN, build_adapter, peft_greedy

from pagedllm import LLM
from pagedllm.lora.request import LoRARequest

pytest.importorskip("peft")

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    a = build_adapter(tiny_llama, root / "a", seed=1, r=4, targets=["q_proj", "v_proj"])
    b = build_adapter(tiny_llama, root / "b", seed=2, r=8, targets=ALL, use_rslora=True)
    c = build_adapter(tiny_llama, root / "c", seed=3, r=2, targets=ATTN)
    return a, b, c


def _llm(model, **kw) -> LLM:
    return LLM(model=str(model), enable_lora=True, max_loras=2, max_lora_rank=8, **kw)


def _run(llm: LLM, prompts, loras):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy_params(MAX_TOKENS),
        use_tqdm=False,
        lora_request=loras,
    )
    llm.llm_engine.check_integrity()
    return outs


def test_mixed_batch_matches_peft_and_keeps_prefix_cache_apart(tiny_llama, adapters):
    a, b, _ = adapters
    shared = random_prompts(1, 40, 40, seed=5)[0]  # 2+ full blocks, the same for all three
    others = random_prompts(3, 5, 30, seed=6)
    prompts = [shared, shared, shared, *others]
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    loras = [None, ra, rb, None, ra, rb]
    llm = _llm(tiny_llama)
    outs = _run(llm, prompts, loras)
    got = [o.outputs[0].token_ids for o in outs]
    folder = {None: None, 1: a, 2: b}
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        want = peft_greedy(tiny_llama, folder[lora and lora.lora_int_id], [prompt], MAX_TOKENS)
        assert got[i] == want[0], f"prompt {i} (adapter {lora and lora.lora_name})"
    assert len({tuple(g) for g in got[:3]}) == 3  # the adapters change the output
    manager = llm.llm_engine.executor.local_runner.lora
    assert max(manager.adapters_per_step) == 2  # both adapters (and the base) in one step
    # One batch: the shared prompt's blocks are cached only under the base model's key
    # before either adapter looks, so no adapter hits them.
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0]

    again = _run(llm, [shared, shared, shared], [None, ra, rb])
    assert [o.outputs[0].token_ids for o in again] == got[:3]
    assert all(o.num_cached_tokens >= 32 for o in again)  # each hits its own blocks
    assert manager.num_loads == 2  # resident adapters are not read again


def test_prefix_cache_never_crosses_adapters(tiny_llama, adapters):
    a, _, c = adapters
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    llm = _llm(tiny_llama)
    first = _run(llm, [prompt], [LoRARequest("a", 1, str(a))])[0]
    assert first.num_cached_tokens == 0
    # Same tokens, another adapter (even one from the same folder under a new id): no hit.
    for req in (LoRARequest("c", 3, str(c)), LoRARequest("a-again", 4, str(a)), None):
        assert _run(llm, [prompt], [req])[0].num_cached_tokens == 0
    assert _run(llm, [prompt], [LoRARequest("a", 1, str(a))])[0].num_cached_tokens >= 32


def test_more_adapters_than_slots_evicts_and_stays_correct(tiny_llama, adapters):
    a, b, c = adapters
    prompts = random_prompts(3, 10, 20, seed=11)
    reqs = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), LoRARequest("c", 3, str(c))]
    llm = _llm(tiny_llama)  # two slots, three adapters: the third waits, then evicts one
    got = [o.outputs[0].token_ids for o in _run(llm, prompts, reqs)]
    want = [peft_greedy(tiny_llama, f, [p], MAX_TOKENS)[0] for f, p in zip((a, b, c), prompts)]
    assert got == want
    manager = llm.llm_engine.executor.local_runner.lora
    assert manager.num_loads == 3
    assert max(manager.adapters_per_step) == 2  # the scheduler kept each step within the slots


def test_bad_lora_requests_are_value_errors(tiny_llama, adapters, tmp_path):
    a = adapters[0]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=str(tiny_llama)).generate("hi", lora_request=LoRARequest("a", 1, str(a)))
    llm = _llm(tiny_llama)
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate([3, 4, 5], lora_request=LoRARequest("x", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(model=str(tiny_llama), enable_lora=True, max_lora_rank=2).generate(
            [3, 4, 5], lora_request=LoRARequest("a", 1, str(a))
        )
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, str(a))
    with pytest.raises(ValueError, match="max_loras"):
        LLM(model=str(tiny_llama), enable_lora=True, max_loras=0)

"""Multi-LoRA under tensor parallelism (two gloo processes on the CPU): A and B sharded as
their layers are, a mixed batch still equal to transformers + peft."""

from __future__ import annotations

import pytest
from helpers.generation import greedy_params, random_prompts
from helpers.lora import ALL, build_adapter, most_adapters_in_a_step, peft_greedy
from helpers.tp import BASE

from pagedllm import LLM
from pagedllm.lora.request import LoRARequest

pytest.importorskip("peft")


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: the KV heads are replicated on both ranks
def test_tp2_mixed_batch_matches_peft(model_factory, tmp_path, kv_heads):
    base = model_factory("llama", num_key_value_heads=kv_heads)
    a = build_adapter(base, tmp_path / "a", seed=1, r=4, targets=ALL)
    b = build_adapter(base, tmp_path / "b", seed=2, r=8, targets=["q_proj", "v_proj", "down_proj"])
    prompts = random_prompts(4, 5, 30, seed=3)
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    loras = [ra, None, rb, ra]
    llm = LLM(
        str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, **BASE
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            greedy_params(8),
            use_tqdm=False,
            lora_request=loras,
        )
        counts = llm.llm_engine.executor.collective_rpc(most_adapters_in_a_step)
    finally:
        llm.llm_engine.shutdown()
    folders = {None: None, 1: a, 2: b}
    for prompt, lora, out in zip(prompts, loras, outs):
        want = peft_greedy(base, folders[lora and lora.lora_int_id], [prompt], 8)[0]
        assert out.outputs[0].token_ids == want
    assert counts == [2, 2]  # both ranks ran both adapters in one step

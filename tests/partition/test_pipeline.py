"""Pipelined split: several engine steps (micro-batches of the running sequences) in flight
across the tiers, against Hugging Face greedy."""

from __future__ import annotations

import random

from helpers.oracle import hf_greedy
from helpers.partition import inprocess_cloud, make_plan

from pagedllm import LLM, SamplingParams

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)


def test_pipelined_split_matches_hf_with_two_micro_batches_in_flight(model_factory, tmp_path):
    model = model_factory("llama", num_hidden_layers=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 10), ignore_eos=True)
        for _ in prompts
    ]
    plan = make_plan(model, 2, tmp_path / "plan.json")
    with inprocess_cloud(model, plan) as (cloud, server):
        llm = LLM(
            str(model),
            partition_config={"plan": str(plan), "address": server.address, "pipeline_depth": 2},
            max_num_batched_tokens=32,  # chunks some prompts, so prefill and decode mix
            **ENGINE,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_prefill_chunks > 0
        executor = llm.llm_engine.executor
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.block_manager.usage == 0.0
        # an abort while a step is in flight loses nothing else
        engine = llm.llm_engine
        for i, p in enumerate(prompts[:4]):
            engine.add_request(
                f"x{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            )
        engine.step()
        engine.step()
        engine.abort_request("x1")
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        engine.check_integrity()
    assert executor.max_outstanding == 2  # micro-batch i+1 was sent before i came back
    for out, prompt, p in zip(outs, prompts, params):
        assert out.outputs[0].token_ids == hf_greedy(model, [prompt], p.max_tokens)[0]
    assert sorted(done) == ["x0", "x2", "x3"]
    assert done["x2"] == hf_greedy(model, [prompts[2]], 6)[0]

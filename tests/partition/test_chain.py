"""A chain of three tiers at run time: edge (engine, embedding, layers [0, 1)) -> gateway
(layers [1, 3)) -> cloud (layer 3, norm, head), against Hugging Face greedy."""

from __future__ import annotations

import random
import time

import pytest
from helpers.oracle import hf_greedy
from helpers.partition import inprocess_cloud, launch_worker, make_plan, ready

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.partition.runtime import CloudWorker

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)


def test_three_tier_chain_matches_hf(model_factory, tmp_path):
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, [1, 3], tmp_path / "plan.json")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(2, 24))] for _ in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cloud = ready(launch_worker(model, plan))  # the last tier, in a process of its own
    try:
        with inprocess_cloud(model, plan, role="tier1", next_address=cloud.address) as (
            gateway,
            server,
        ):
            assert gateway.tier.layers == (1, 3)
            llm = LLM(
                str(model),
                partition_config={"plan": str(plan), "address": server.address},
                max_num_batched_tokens=16,  # chunked prefill crosses both links too
                **ENGINE,
            )
            assert llm.llm_engine.executor.runner.model_config.layer_range == (0, 1)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            assert llm.llm_engine.scheduler.num_prefill_chunks > 0
            assert gateway.seqs  # the gateway mirrored the sequences it ran layers 1-2 for
            llm.llm_engine.shutdown()
    finally:
        cloud.kill()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, 8)


def test_a_tier_in_between_needs_the_next_address(model_factory, tmp_path):
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, [1, 3], tmp_path / "plan.json")
    args = EngineArgs(
        model=str(model), partition_config={"plan": str(plan), "role": "tier1"}, **ENGINE
    )
    with pytest.raises(ValueError, match="next tier's address"):
        CloudWorker(args.create_engine_config())
    bad = EngineArgs(
        model=str(model), partition_config={"plan": str(plan), "role": "tier5"}, **ENGINE
    )
    with pytest.raises(ValueError, match="not a tier"):
        CloudWorker(bad.create_engine_config())


def test_a_pipelined_chain_overlaps_at_the_tier_in_between(model_factory, tmp_path, monkeypatch):
    """Depth 2 through edge -> gateway -> cloud: the gateway hands a step on and takes the
    next one before the cloud's reply is back (two steps in flight past it), and the
    outputs still equal HF's. The cloud holds its first replies until a second step is in
    flight at the gateway (or 10 s pass): whether the overlap happens is then decided by
    the gateway's design, not by how fast this machine's threads ran; a gateway that waits
    for each reply before taking the next step never gets there and fails the test."""
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, [1, 3], tmp_path / "plan.json")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(2, 12))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with inprocess_cloud(model, plan) as (cloud, cloud_server):
        with inprocess_cloud(model, plan, role="tier1", next_address=cloud_server.address) as (
            gateway,
            server,
        ):
            forward = cloud.runner.forward

            def held_forward(*args, **kwargs):
                deadline = time.monotonic() + 10
                while gateway.max_in_flight < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
                return forward(*args, **kwargs)

            monkeypatch.setattr(cloud.runner, "forward", held_forward)
            llm = LLM(
                str(model),
                partition_config={
                    "plan": str(plan),
                    "address": server.address,
                    "pipeline_depth": 2,
                },
                **ENGINE,
            )
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            assert llm.llm_engine.executor.max_outstanding == 2
            assert gateway.max_in_flight == 2
            llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, 8)

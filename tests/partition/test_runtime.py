"""Split execution (edge here, cloud in a subprocess on 127.0.0.1) against the unsplit
engine and Hugging Face, and what happens when either side goes away."""

from __future__ import annotations

import random
import time

import pytest
import torch
from helpers.oracle import hf_greedy
from helpers.partition import inprocess_cloud, launch_worker, make_plan, ready

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.partition.runtime import decode_hidden, encode_hidden

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)


def prompts_with_shared_prefix(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(13)]
    alone = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    tails = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    return alone + [shared + t for t in tails]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.block_manager.usage == 0.0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def deep_llama(model_factory):
    return model_factory("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(deep_llama):
    prompts = prompts_with_shared_prefix()
    return prompts, hf_greedy(deep_llama, prompts, 8)


CUTS = [1, 2, 3]


@pytest.fixture(scope="module")
def cut_workers(deep_llama, tmp_path_factory):
    """cut -> (plan, worker): one cloud worker per cut, started side by side."""
    folder = tmp_path_factory.mktemp("plans")
    plans = {cut: make_plan(deep_llama, cut, folder / f"cut{cut}.json") for cut in CUTS}
    # the last one through `pagedllm serve --role cloud`, the others through split-worker
    procs = {cut: launch_worker(deep_llama, plans[cut], via_serve=cut == 3) for cut in CUTS}
    started = {}
    try:
        for cut in CUTS:
            started[cut] = (plans[cut], ready(procs[cut]))
        yield started
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=30)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("cut", CUTS)
def test_split_matches_unsplit_and_hf(deep_llama, reference, cut_workers, cut):
    prompts, hf = reference
    plan, worker = cut_workers[cut]
    # A small token budget chunks the prompts and batches chunks with decodes.
    engine = dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4)
    unsplit = generate(LLM(str(deep_llama), **engine), prompts, GREEDY)
    split_llm = LLM(
        str(deep_llama), partition_config={"plan": str(plan), "address": worker.address}, **engine
    )
    assert generate(split_llm, prompts, GREEDY) == unsplit == hf
    assert split_llm.llm_engine.scheduler.num_prefill_chunks > 0  # prompts ran in chunks
    # Again: the shared prefix now comes from the prefix cache on both tiers.
    hits = split_llm.llm_engine.block_manager.prefix_cache_hits
    assert generate(split_llm, prompts, GREEDY) == hf
    assert split_llm.llm_engine.block_manager.prefix_cache_hits > hits


def test_tied_embeddings_and_seeded_sampling(model_factory, tmp_path):
    """Qwen2 ties the head to the embedding, which only the edge holds; seeded sampling
    and logprobs happen on the cloud and match the unsplit engine's."""
    model = model_factory("qwen2", num_hidden_layers=3)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    prompts = prompts_with_shared_prefix(seed=1)
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=6, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    unsplit = LLM(str(model), **ENGINE).generate(prompts, params, use_tqdm=False)
    with inprocess_cloud(model, plan) as (_, server):
        split_llm = LLM(
            str(model), partition_config={"plan": str(plan), "address": server.address}, **ENGINE
        )
        split = split_llm.generate(prompts, params, use_tqdm=False)
        greedy = generate(split_llm, prompts[:2], GREEDY)
    for a, b in zip(unsplit, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for tok in lp_a:
                assert lp_a[tok].logprob == pytest.approx(lp_b[tok].logprob, abs=1e-5)
    assert greedy == hf_greedy(model, prompts[:2], 8)


def test_int8_wire_round_trip():
    hidden = torch.randn(5, 64) * torch.tensor([[0.1], [1.0], [10.0], [100.0], [1e-3]])
    tensors = encode_hidden(hidden, "int8")
    assert tensors["hidden_q"].dtype == torch.int8
    back = decode_hidden(tensors, torch.float32, torch.device("cpu"))
    # symmetric per-token quantization: error at most half a step of that token's scale
    step = hidden.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - hidden).abs() <= step / 2 + 1e-6).all()
    assert encode_hidden(hidden, "bfloat16")["hidden"].dtype == torch.bfloat16


def test_lost_cloud_fails_requests_and_frees_blocks(deep_llama, workers, tmp_path):
    plan = make_plan(deep_llama, 2, tmp_path / "plan.json")
    worker = workers(deep_llama, plan)  # its own: this test kills it
    args = EngineArgs(
        model=str(deep_llama),
        partition_config={"plan": str(plan), "address": worker.address},
        **ENGINE,
    )
    engine = LLMEngine.from_engine_args(args)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts_with_shared_prefix()[:3]):
        engine.add_request(str(i), p, long)
    for _ in range(3):
        engine.step()
    worker.kill()
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
    for out in outputs:
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "cloud worker" in out.error
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.usage == 0.0 and not engine.block_manager.hash_to_block
    # While the cloud is down a new request fails too; once it is back, requests work again.
    engine.add_request("lonely", [5, 6, 7], GREEDY)
    assert engine.step()[0].outputs[0].finish_reason == "error"
    with inprocess_cloud(deep_llama, plan, address=worker.address):
        engine.add_request("again", [5, 6, 7], GREEDY)
        while engine.has_unfinished_requests():
            outs = engine.step()
        engine.shutdown()
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].token_ids == hf_greedy(deep_llama, [[5, 6, 7]], 8)[0]


def test_cloud_forgets_an_edge_that_leaves_and_serves_one_at_a_time(deep_llama, tmp_path):
    plan = make_plan(deep_llama, 1, tmp_path / "plan.json")
    with inprocess_cloud(deep_llama, plan) as (cloud, server):
        edge_args = EngineArgs(
            model=str(deep_llama),
            partition_config={"plan": str(plan), "address": server.address},
            **ENGINE,
        )
        edge = LLMEngine.from_engine_args(edge_args)
        edge.add_request("a", [4, 5, 6, 7, 8], SamplingParams(max_tokens=30, ignore_eos=True))
        edge.step()
        edge.step()
        assert len(cloud.seqs) == 1
        with pytest.raises(ValueError, match="already serves an edge"):
            LLMEngine.from_engine_args(edge_args)
        edge.shutdown()  # the edge goes away mid-request
        deadline = time.time() + 10
        while cloud.seqs and time.time() < deadline:
            time.sleep(0.05)
        assert not cloud.seqs


def test_edge_serves_the_openai_api_and_reports_a_lost_cloud(deep_llama, tmp_path):
    import httpx

    from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

    plan = make_plan(deep_llama, 2, tmp_path / "plan.json")
    prompt = [7, 8, 9, 10, 11]
    body = {"model": "split", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    with inprocess_cloud(deep_llama, plan) as (_, cloud_server):
        args = EngineArgs(
            model=str(deep_llama),
            partition_config={"plan": str(plan), "address": cloud_server.address},
            **ENGINE,
        )
        app = build_app(args, ["split"], log_stats_interval=None)
        with serve_in_thread(app) as url:
            ok = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            cloud_server.stop(None)  # the cloud goes away
            lost = httpx.post(url + "/v1/completions", json=body, timeout=60)
    expected = LLM(str(deep_llama), **ENGINE).generate([prompt], GREEDY, use_tqdm=False)
    assert ok["choices"][0]["text"] == expected[0].outputs[0].text
    assert lost.status_code == 500
    assert "lost the connection to the cloud worker" in lost.json()["error"]["message"]


def test_preemption_on_a_small_cache_matches_hf(deep_llama, reference, cut_workers):
    prompts, hf = reference
    plan, worker = cut_workers[2]
    # 24 blocks of 4 tokens cannot hold six sequences of up to 38 tokens at once.
    engine = dict(ENGINE, kv_cache_memory_bytes=24 * 2048)  # edge: 2 layers x 2048 B/block
    split_llm = LLM(
        str(deep_llama), partition_config={"plan": str(plan), "address": worker.address}, **engine
    )
    assert split_llm.llm_engine.block_manager.num_blocks == 24
    assert generate(split_llm, prompts, GREEDY) == hf
    assert split_llm.llm_engine.scheduler.num_preemptions > 0


def test_int8_wire_runs_end_to_end(deep_llama, reference, cut_workers, tmp_path):
    """The edge's plan picks the wire format; the cloud reads whichever arrives."""
    prompts, hf = reference
    _, worker = cut_workers[2]
    plan = make_plan(deep_llama, 2, tmp_path / "int8.json", wire_dtype="int8")
    split_llm = LLM(
        str(deep_llama), partition_config={"plan": str(plan), "address": worker.address}, **ENGINE
    )
    got = generate(split_llm, prompts, GREEDY)
    # int8 rounding may flip a near-tie now and then; here it changes almost nothing
    same = sum(a == b for x, y in zip(got, hf) for a, b in zip(x, y))
    assert same >= 0.9 * sum(map(len, hf))

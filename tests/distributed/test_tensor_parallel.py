"""Tensor parallel over two gloo processes on the CPU: same greedy tokens as TP=1 and as HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.generation import greedy, random_prompts
from helpers.oracle import hf_greedy
from helpers.tp import BASE, generate_both_ways, parameter_shapes
from safetensors import safe_open

from pagedllm import LLM

ARCHS = ["llama", "llama3_rope", "mistral", "qwen2"]


@pytest.fixture
def tp_llm():
    engines: list[LLM] = []

    def make(model_dir: Path, **kwargs: object) -> LLM:
        engines.append(LLM(str(model_dir), tensor_parallel_size=2, **{**BASE, **kwargs}))
        return engines[-1]

    yield make
    for llm in engines:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1_and_hf(model_factory, tp_llm, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(6, 1, 40)
    want = hf_greedy(model_dir, prompts, 10)
    assert greedy(LLM(str(model_dir), **BASE), prompts, 10) == want
    assert generate_both_ways(tp_llm(model_dir), prompts, 10) == want


def test_kv_heads_fewer_than_ranks_with_preemption_and_prefix_cache(model_factory, tp_llm):
    model_dir = model_factory("llama", num_key_value_heads=1)
    # 1 KV head of 16 dims, 2 layers, fp32: 1 KiB per 4-token block; 40 blocks hold ~3 of
    # the 8 sequences below (~12 blocks each), so the scheduler must preempt.
    llm = tp_llm(model_dir, kv_cache_memory_bytes=40 * 1024, max_num_seqs=8)
    shared = random_prompts(1, 17, 17, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(8, 4, 12, seed=3)]
    want = hf_greedy(model_dir, prompts, 16)
    engine = llm.llm_engine
    assert generate_both_ways(llm, prompts, 16) == want
    assert engine.scheduler_stats().num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0  # the shared 16-token prefix


def test_each_rank_loads_only_its_shard(model_factory, tp_llm):
    model_dir = model_factory("llama", num_key_value_heads=1)
    llm = tp_llm(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    ranks = llm.llm_engine.executor.collective_rpc(parameter_shapes)
    assert ranks[0] == ranks[1]  # the same shard shapes on both ranks
    shapes = ranks[0]
    hidden, inter = full["model.norm.weight"][0], full["model.layers.0.mlp.up_proj.weight"][0]
    q_out, kv_out = (full[f"model.layers.0.self_attn.{p}_proj.weight"][0] for p in "qk")
    vocab = full["model.embed_tokens.weight"][0]
    assert shapes["model.embed_tokens.weight"] == (vocab // 2, hidden)
    assert shapes["lm_head.weight"] == (vocab // 2, hidden)
    layer = "model.layers.0."
    assert shapes[layer + "self_attn.o_proj.weight"] == (hidden, q_out // 2)
    assert shapes[layer + "mlp.down_proj.weight"] == (hidden, inter // 2)
    assert shapes[layer + "mlp.gate_up_proj.weight"] == (2 * inter // 2, hidden)
    # half the query heads; the single KV head is replicated on both ranks
    assert shapes[layer + "self_attn.qkv_proj.weight"] == (q_out // 2 + 2 * kv_out, hidden)
    rank_numel = sum(torch.Size(s).numel() for s in shapes.values())
    full_numel = sum(torch.Size(s).numel() for s in full.values())
    assert rank_numel < 0.6 * full_numel

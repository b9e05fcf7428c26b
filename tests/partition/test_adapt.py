"""Adaptation: the running split measures its link and tiers, and re-planning follows
what it measures with hysteresis."""

from __future__ import annotations

import pytest
from helpers.partition import emulated_link, make_plan

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.partition import DeviceProfile, GraphPartitioner, LayerTimings, LinkProfile
from pagedllm.partition.adapt import LinkSnapshot, Replanner
from pagedllm.partition.graph import GraphNode, ModelGraph
from pagedllm.partition.profiles import DecodePoint
from pagedllm.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
L = 8


def _graph() -> ModelGraph:
    free = dict(
        streamed_bytes=0,
        flops_per_sample=0.0,
        attn_flops_per_pair=0.0,
        kv_bytes_per_token=0,
        read_bytes_per_token=0,
        num_ops=0,
    )
    nodes = [GraphNode("embed", 0, flops_per_token=0.0, **free)]
    nodes += [GraphNode("layer", 1 << 20, flops_per_token=1e6, **free)] * L
    nodes += [GraphNode("head", 0, flops_per_token=0.0, **free)]
    graph = ModelGraph("uniform", tuple(nodes), hidden_size=64, dtype="float32")
    for name, ms in (("edge", 2.0), ("cloud", 1.0)):
        layer = (0.0,) + (ms / 1e3,) * L + (0.0,)
        points = tuple(
            DecodePoint(b, c, layer, 0.0, 0.0, 0.0) for b, c in ((1, 8), (1, 64), (4, 8))
        )
        graph = graph.with_timings(
            LayerTimings(name, 1, 8, 8, layer, layer, 0.0, 0.0, 0.0, 1, points)
        )
    return graph


DEVICES = [DeviceProfile(n, {"float32": 1e12}, 1e12, 8 << 30) for n in ("edge", "cloud")]


def test_replanning_follows_a_slower_tier_but_not_noise():
    # min_cloud_throughput 240 tok/s: the cloud may hold at most 4.17 ms of layers
    partitioner = GraphPartitioner(constraints={"min_cloud_throughput": 240}, batch_size=1)
    link = LinkProfile(1000, 1.0)
    plan = partitioner.analyze(_graph(), DEVICES, link)
    assert plan.cuts == (4,)  # cloud: 4 layers x 1 ms
    replanner = Replanner(partitioner, _graph(), DEVICES, link, plan.cuts)
    edge_ms, cloud_ms = plan.chosen.tiers[0].decode_ms, plan.chosen.tiers[1].decode_ms
    # measurements a few percent off the plan, the link's delay up and down: no move
    for i, (e, c, rtt) in enumerate([(1.03, 0.97, 1.0), (0.97, 1.02, 30.0), (1.01, 1.03, 2.0)]):
        seen = LinkSnapshot(16, edge_ms * e, cloud_ms * c, rtt, 512)
        assert replanner.replan(seen).cuts == (4,), i
    assert replanner.moves == 0
    # the cloud now runs twice as slow as profiled: fewer layers fit its throughput limit
    seen = LinkSnapshot(16, edge_ms, cloud_ms * 2, 1.0, 512)
    moved = replanner.replan(seen)
    assert moved.cuts == (6,) and replanner.moves == 1
    # measured again at the new cut (the cloud still slow): the plan stays put
    seen = LinkSnapshot(
        16, moved.chosen.tiers[0].decode_ms, moved.chosen.tiers[1].decode_ms, 1.0, 512
    )
    assert replanner.replan(seen).cuts == (6,) and replanner.moves == 1


def test_the_running_split_measures_the_emulated_delay_as_it_changes(model_factory, tmp_path):
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    with emulated_link(model, plan, rtt_ms=2) as link:
        args = EngineArgs(
            model=str(model), partition=str(plan), partition_address=link.address, **ENGINE
        )
        engine = LLMEngine.from_engine_args(args)
        monitor = engine.executor.monitor
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        engine.add_request("a", [4, 5, 6, 7], params)
        for _ in range(20):
            engine.step()
        before = monitor.snapshot()
        link.proxy.set(rtt_ms=40)  # the delay changes mid-run
        for _ in range(20):
            engine.step()
        after = monitor.snapshot()
        engine.shutdown()
    assert before.steps == after.steps == 16
    assert 2 <= before.link_ms < 2 + 25, before
    assert 40 <= after.link_ms < 40 + 25, after
    # the tiers' own times are measured apart from the link's
    assert after.remote_ms < after.link_ms and after.edge_ms < after.link_ms
    assert after.remote_ms == pytest.approx(before.remote_ms, abs=20)

"""Adaptation: the running split measures its link and tiers, and re-planning follows
what it measures with hysteresis."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.partition import emulated_link, inprocess_cloud, make_plan

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.partition import (
    DeviceProfile,
    GraphPartitioner,
    LayerTimings,
    LinkProfile,
    PartitionPlan,
)
from pagedllm.partition.adapt import LinkMonitor, LinkSnapshot, Replanner
from pagedllm.partition.graph import GraphNode, ModelGraph, graph_for_model
from pagedllm.partition.netem import DelayProxy
from pagedllm.partition.profiles import DecodePoint
from pagedllm.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
L = 8
LATE = 8  # _forced_moves: the step a request sharing a cached prefix arrives


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
            model=str(model),
            partition_config={"plan": str(plan), "address": link.address},
            **ENGINE,
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
    # Lower bounds: the link's figure holds the delay the proxy adds, before and after the
    # change (a busy machine adds to it, never takes away).
    assert before.link_ms >= 2, before
    assert after.link_ms >= 40, after
    # the tiers' own times are measured apart from the link's (each tier reports its own)
    assert after.remote_ms > 0 and after.edge_ms > 0


# ---- the cut moves while the split runs ------------------------------------------------------
class EmulatedFigures:
    """What the split's monitor records per step, emulated: an edge of edge_ms and a cloud
    of cloud_ms per decoder layer they hold, and a link of the delay the proxy is set to.
    The run itself is real (both tiers, the proxy delaying the RPCs, the cut moving); only
    the figures the re-planner reads are the emulation's, so that this machine's load, which
    would stretch every measured time, cannot move the cut. That the monitor measures a real
    link's delay: test_the_running_split_measures_the_emulated_delay_as_it_changes."""

    def __init__(self, monkeypatch, edge_ms: float, cloud_ms: float, rtt_ms: float) -> None:
        self.edge_ms, self.cloud_ms, self.rtt_ms = edge_ms, cloud_ms, rtt_ms
        self.executor = None  # set once the engine is made: the figures follow its cut
        real_sent = LinkMonitor.sent
        figures = self

        def sent(monitor: LinkMonitor, edge_s: float, nbytes: int) -> None:
            real_sent(monitor, figures.edge_ms * figures.cut / 1e3, nbytes)

        def received(monitor: LinkMonitor, remote_ms: float, nbytes: int) -> None:
            if monitor._sent:
                _, edge_s, sent_bytes = monitor._sent.popleft()
                cloud = figures.cloud_ms * (L - figures.cut)
                row = (edge_s * 1e3, cloud, figures.rtt_ms, sent_bytes + nbytes)
                monitor._rows.append(row)

        monkeypatch.setattr(LinkMonitor, "sent", sent)
        monkeypatch.setattr(LinkMonitor, "received", received)

    @property
    def cut(self) -> int:
        return self.executor.tier.cut


def _measured(name: str, ms_per_layer: float, layers: int) -> LayerTimings:
    nodes = (0.0,) + (ms_per_layer / 1e3,) * layers + (0.0,)
    return LayerTimings(name, 1, 64, 8, nodes, nodes, 0.0, 0.0, 0.0, 1)


def _plan_with_basis(model, path, layers: int, edge_ms: float, cloud_ms: float):
    graph = graph_for_model(str(model), "float32")
    graph = graph.with_timings(_measured("edge", edge_ms, layers))
    graph = graph.with_timings(_measured("cloud", cloud_ms, layers))
    # the most tokens/s pipelined, each token within 24 ms end to end
    partitioner = GraphPartitioner(
        "throughput_aware", {"max_edge_latency": 24}, context_len=64, wire_dtype="float32"
    )
    devices = [DeviceProfile(n, {"float32": 1e12}, 1e12, 8 << 30) for n in ("edge", "cloud")]
    plan = partitioner.analyze(graph, devices, LinkProfile(1000, 1.0))
    plan.save(path)
    return plan


def test_the_cut_moves_when_the_emulated_delay_changes_and_back(model_factory, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """8 layers, the edge 3 ms per layer, the cloud 1 ms. Over a 1 ms link the plan cuts at
    2 (6 + 6 ms: the stages balance, ~15 ms per token end to end). With 20 ms of delay no
    cut keeps 24 ms, and the one closest to it gives the cloud a layer more (cut 1: 3 + 7
    ms); back at 1 ms the cut returns to 2. The tokens match the unsplit engine's, though
    every move recomputes the running sequence."""
    model = model_factory("llama", num_hidden_layers=8)
    plan = _plan_with_basis(model, tmp_path / "plan.json", 8, edge_ms=3.0, cloud_ms=1.0)
    assert plan.cuts == (2,)
    prompts = [[3 + (7 * i + j) % 300 for j in range(5 + i % 4)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    unsplit = LLM(str(model), **ENGINE).generate(prompts, params, use_tqdm=False)
    expected = {str(i): o.outputs[0].token_ids for i, o in enumerate(unsplit)}

    figures = EmulatedFigures(monkeypatch, edge_ms=3.0, cloud_ms=1.0, rtt_ms=1.0)
    got: dict[str, list[int]] = {}
    with inprocess_cloud(model, tmp_path / "plan.json") as (cloud, server):
        with DelayProxy(server.address, rtt_ms=1.0) as proxy:
            args = EngineArgs(
                model=str(model),
                partition_config={
                    "plan": str(tmp_path / "plan.json"),
                    "address": proxy.address,
                    "replan_interval": 8,
                },
                **ENGINE,
            )
            engine = LLMEngine.from_engine_args(args)
            executor = engine.executor
            figures.executor = executor
            queue = iter(enumerate(prompts))

            def run(steps: int, until_moves: int | None = None) -> None:
                for _ in range(steps):
                    if not engine.has_unfinished_requests():
                        i, prompt = next(queue)
                        engine.add_request(str(i), prompt, params)
                    for out in engine.step():
                        if out.finished:
                            got[out.request_id] = out.outputs[0].token_ids
                    if until_moves is not None and len(executor.moves) == until_moves:
                        return

            run(48)  # six re-plans at 1 ms: the cut stays
            assert executor.moves == [] and executor.replanner.moves == 0
            proxy.set(rtt_ms=20.0)
            figures.rtt_ms = 20.0
            run(80, until_moves=1)
            assert executor.moves == [(2, 1)]
            assert executor.tier.layers == (0, 1) and cloud.tier.layers == (1, 8)
            preempted = engine.scheduler.num_preemptions
            assert preempted >= 1  # the running sequence was recomputed at the new cut
            run(32)  # measured at the new cut, still 20 ms: it stays
            assert executor.moves == [(2, 1)]
            proxy.set(rtt_ms=1.0)
            figures.rtt_ms = 1.0
            run(80, until_moves=2)
            assert executor.moves == [(2, 1), (1, 2)]
            assert cloud.tier.layers == (2, 8)
            while engine.has_unfinished_requests():
                run(1)
            engine.shutdown()
    assert got and all(got[rid] == expected[rid] for rid in got), got


def test_a_saved_plan_carries_what_replanning_needs(tmp_path):
    """The plan file records the partitioner's settings, graph, timings and profiles:
    Replanner.from_plan plans the same cut from it; without timings measured on both
    devices it says what is missing."""
    partitioner = GraphPartitioner(constraints={"min_cloud_throughput": 240}, batch_size=1)
    link = LinkProfile(1000, 1.0)
    plan = partitioner.analyze(_graph(), DEVICES, link)
    plan.save(tmp_path / "plan.json")
    loaded = PartitionPlan.load(tmp_path / "plan.json")
    replanner = Replanner.from_plan(loaded)
    assert replanner.cuts == plan.cuts == (4,)
    assert replanner.partitioner.constraints == {"min_cloud_throughput": 240}
    again = replanner.partitioner.analyze(replanner.graph, replanner.devices, replanner.link)
    assert again.cuts == (4,)
    assert again.chosen.decode_latency_ms == pytest.approx(plan.chosen.decode_latency_ms)

    unmeasured = GraphPartitioner().analyze(
        dataclasses.replace(_graph(), measured={}), DEVICES, link
    )
    with pytest.raises(ValueError, match="no layer timings measured on edge, cloud"):
        Replanner.from_plan(unmeasured)


def _forced_moves(model, plan, cuts_at: dict[int, int], depth: int = 1):
    """Greedy outputs of a split whose cut is moved at the given engine steps (step ->
    cut), with the moves the edge made and the cloud's layers at the end."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 12], [40, 41, 42], [7] * 9]
    late = [5, 6, 7, 8, 9, 10, 13]  # added at step LATE: its first block is in the cache
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with inprocess_cloud(model, plan) as (cloud, server):
        args = EngineArgs(
            model=str(model),
            partition_config={
                "plan": str(plan),
                "address": server.address,
                "pipeline_depth": depth,
            },
            enable_prefix_caching=True,
            max_num_batched_tokens=16,  # prompts in chunks, batched with decodes
            **ENGINE,
        )
        engine = LLMEngine.from_engine_args(args)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs, step = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            step += 1
            if step == LATE:
                engine.add_request(str(len(prompts)), late, params)
            if step in cuts_at:
                engine.executor.pending_cut = cuts_at[step]
        engine.check_integrity()
        prompts.append(late)
        result = (
            [outs[str(i)] for i in range(len(prompts))],
            list(engine.executor.moves),
            cloud.tier.layers,
            engine.scheduler.num_preemptions,
            engine.scheduler.num_prefill_chunks,
            engine.block_manager.prefix_cache_hits,
        )
        engine.shutdown()
    return prompts, params, result


@pytest.mark.parametrize("depth", [1, 2])
def test_moving_the_cut_mid_run_keeps_the_tokens(model_factory, tmp_path, depth):
    """Moves at steps 4 and 11 (mid-prefill, then mid-decode), with chunked prefill, prefix
    caching and, at depth 2, steps in flight that are drained first: the outputs equal the
    unsplit engine's, and each move preempted the running sequences."""
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    prompts, params, (got, moves, cloud_layers, preempted, chunks, hits) = _forced_moves(
        model, plan, {4: 3, 11: 1}, depth
    )
    unsplit = LLM(str(model), **ENGINE).generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in unsplit]
    assert moves == [(2, 3), (3, 1)] and cloud_layers == (1, 4)
    assert preempted >= 2
    assert chunks > 0  # prompts did run in pieces
    assert hits > 0  # and the shared prefix was found in the cache


def test_a_cut_the_worker_refuses_leaves_the_split_where_it_was(model_factory, tmp_path):
    """A cut at the last layer leaves the cloud no layers: the worker refuses it, the edge
    goes back to the old cut, stops re-planning, and the requests finish correctly."""
    model = model_factory("llama", num_hidden_layers=4)
    plan = make_plan(model, 2, tmp_path / "plan.json")
    prompts, params, (got, moves, cloud_layers, *_) = _forced_moves(model, plan, {5: 4})
    unsplit = LLM(str(model), **ENGINE).generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in unsplit]
    assert moves == [] and cloud_layers == (2, 4)

"""The partitioner on hand-made profiles whose optimum is known, and its reports."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.entrypoints.cli import main
from pagedllm.partition import DeviceProfile, GraphPartitioner, LayerTimings, LinkProfile
from pagedllm.partition.graph import GraphNode, ModelGraph, graph_for_model
from pagedllm.partition.plan import PartitionPlan

MIB = 1 << 20
L = 10


def uniform_graph(layer_flops: float = 4e6) -> ModelGraph:
    """L identical layers of layer_flops per token and 1 MiB of weights; free embed/head."""
    free = dict(
        streamed_bytes=0,
        flops_per_sample=0.0,
        attn_flops_per_pair=0.0,
        kv_bytes_per_token=0,
        read_bytes_per_token=0,
        num_ops=0,
    )
    layer = GraphNode("layer", MIB, flops_per_token=layer_flops, **{**free, "streamed_bytes": 0})
    nodes = [GraphNode("embed", 0, flops_per_token=0.0, **free)]
    nodes += [layer] * L
    nodes += [GraphNode("head", 0, flops_per_token=0.0, **free)]
    return ModelGraph("uniform", tuple(nodes), hidden_size=64, dtype="float32")


def device(name: str, ms_per_layer: float) -> DeviceProfile:
    return DeviceProfile(name, {"float32": 4e6 / (ms_per_layer / 1e3)}, 1e12, 64 << 30)


EDGE, CLOUD = device("edge", 4.0), device("cloud", 1.0)
FAST_LINK = LinkProfile(bandwidth_mbps=1e6, rtt_ms=10.0)  # transfers are negligible


def analyze(
    constraints=None, strategy="latency_aware", devices=(EDGE, CLOUD), link=FAST_LINK, graph=None
) -> PartitionPlan:
    partitioner = GraphPartitioner(strategy, constraints, wire_dtype="float32")
    return partitioner.analyze(graph or uniform_graph(), list(devices), link)


def test_latency_aware_puts_the_least_on_the_slow_edge():
    plan = analyze()
    assert plan.feasible and plan.cuts == (1,)
    # latency(k) = 4k (edge) + (10 - k) (cloud) + 10 (link) = 3k + 20
    assert plan.chosen.decode_latency_ms == pytest.approx(23.0, abs=0.01)
    assert plan.chosen.cloud_tokens_per_s == pytest.approx(1000 / 9)


def test_cloud_throughput_pushes_layers_to_the_edge():
    plan = analyze({"min_cloud_throughput": 200})  # cloud at most 5 ms: k >= 5
    assert plan.feasible and plan.cuts == (5,)
    assert plan.chosen.decode_latency_ms == pytest.approx(35.0, abs=0.01)
    assert all(c.holds for c in plan.chosen.checks)


def test_throughput_aware_balances_the_stages():
    plan = analyze(strategy="throughput_aware")  # max(4k, 10 - k) is least at k = 2
    assert plan.cuts == (2,)
    assert plan.chosen.pipelined_tokens_per_s == pytest.approx(1000 / 8)


def test_a_limit_no_cut_meets_is_reported_with_its_shortfall():
    plan = analyze({"max_edge_latency": 10})
    assert not plan.feasible
    assert "max_edge_latency fails at every cut" in plan.message
    assert "(cut 1)" in plan.message and "13 ms over the limit of 10 (130%)" in plan.message
    assert "FAIL" in plan.table() and plan.message in plan.table()


def test_limits_that_only_clash_are_reported_as_such():
    # latency <= 30 needs k <= 3; cloud >= 200 tok/s needs k >= 5
    plan = analyze({"max_edge_latency": 30, "min_cloud_throughput": 200})
    assert not plan.feasible
    assert "no cut meets them all" in plan.message
    assert plan.cuts in {(3,), (4,), (5,)}
    assert any(not c.holds for c in plan.chosen.checks)


def test_edge_memory_limits_the_cut():
    plan = analyze({"max_edge_memory": 3.5 * MIB})  # k MiB of layers on the edge
    assert plan.cuts == (1,)
    plan = analyze({"max_edge_memory": 3.5 * MIB, "min_cloud_throughput": 200})
    assert not plan.feasible
    assert "(min_cloud_throughput at cuts 5-9, max_edge_memory at cuts 1-3 only)" in plan.message


def test_a_chain_of_three_tiers_has_one_cut_per_link():
    chain = (device("phone", 8.0), EDGE, CLOUD)
    plan = analyze(devices=chain)  # 8a + 4(b - a) + (10 - b) + 2 x 10 = 4a + 3b + 30
    assert plan.cuts == (1, 2)
    assert plan.chosen.decode_latency_ms == pytest.approx(40.0, abs=0.01)
    plan = analyze({"min_cloud_throughput": 250}, devices=chain)  # 10 - b <= 4
    assert plan.cuts == (1, 6) and len(plan.chosen.links) == 2
    assert plan.layer_range(1) == (1, 6) and plan.layer_range(-1) == (6, L)


def edge_timings(**fields: object) -> LayerTimings:
    """Measured edge timings of uniform_graph(): 2 ms per layer, free embed and head."""
    defaults = dict(
        device="edge",
        batch_size=1,
        context_len=512,
        prompt_len=128,
        decode_s=(0.0,) + (0.002,) * L + (0.0,),
        prefill_s=(0.0,) * (L + 2),
        engine_s=0.0,
        prepare_s=0.0,
        sample_s=0.0,
    )
    return LayerTimings(**{**defaults, **fields})


def test_measured_timings_replace_the_roofline():
    graph = uniform_graph()
    timings = edge_timings(engine_s=0.001, prepare_s=0.0005)
    plan = analyze({"min_cloud_throughput": 200}, graph=graph.with_timings(timings))
    # edge: 2 ms per layer + engine + prepare; cloud 1 ms per layer; link 10 ms
    assert plan.cuts == (5,)
    assert plan.chosen.tiers[0].decode_ms == pytest.approx(5 * 2 + 1.5)
    assert plan.chosen.decode_latency_ms == pytest.approx(11.5 + 5 + 10, abs=0.01)


def test_a_tier_that_wakes_up_slowly_pays_for_its_idle_time(tmp_path):
    """wake_s: a decode step after the tier idled costs more; the plan adds, for each tier,
    the extra its profile gives at the time it idles per step (the others' share plus the
    link), interpolated between the measured gaps."""
    timings = edge_timings(wake_s=((0.002, 0.0), (0.02, 0.004), (0.08, 0.006)))
    assert timings.wake_penalty_s(0.0) == 0.0
    assert timings.wake_penalty_s(0.011) == pytest.approx(0.002)
    assert timings.wake_penalty_s(0.5) == pytest.approx(0.006)
    path = tmp_path / "t.json"
    timings.save(path)
    assert LayerTimings.load(path) == timings
    graph = uniform_graph().with_timings(timings)
    plain = GraphPartitioner("latency_aware", wire_dtype="float32")
    cut = plain.analyze(graph, [EDGE, CLOUD], FAST_LINK, cuts=[5]).chosen
    # edge: 10 ms of layers; it idles 10 ms (link) + 5 ms (cloud) = 15 ms per step
    assert cut.tiers[0].decode_ms == pytest.approx(10 + 1000 * timings.wake_penalty_s(0.015))
    assert cut.decode_latency_ms == pytest.approx(25 + 1000 * timings.wake_penalty_s(0.015))


def test_plan_round_trips_through_json(tmp_path):
    plan = analyze({"min_cloud_throughput": 200})
    plan.save(tmp_path / "plan.json")
    loaded = PartitionPlan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.chosen == plan.chosen
    with pytest.raises(ValueError, match="cannot read partition plan"):
        PartitionPlan.load(tmp_path / "missing.json")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown constraint"):
        GraphPartitioner(constraints={"max_latency": 1})
    with pytest.raises(ValueError, match="strategy"):
        GraphPartitioner("fastest")
    with pytest.raises(ValueError, match="one link between each pair"):
        GraphPartitioner().analyze(uniform_graph(), [EDGE, CLOUD], [FAST_LINK, FAST_LINK])


def test_link_profiles_parse():
    assert LinkProfile.parse("100mbit,20ms") == LinkProfile(100.0, 20.0)
    assert LinkProfile.parse("1Gbit/s, 500us, 0.5ms") == LinkProfile(1000.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="BANDWIDTH,RTT"):
        LinkProfile.parse("20ms")


def test_graph_is_read_off_the_model(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory("llama")
    graph = graph_for_model(str(path), "float32")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    total = sum(p.numel() * 4 for p in hf.parameters())
    assert sum(n.weight_bytes for n in graph.nodes) == total
    layer = hf.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert graph.nodes[1].flops_per_token == 2 * linear
    assert graph.nodes[1].kv_bytes_per_token == 2 * 2 * 16 * 4  # K and V, 2 kv heads x 16


def test_cli_prints_saves_and_plots(model_factory, tmp_path, capsys):
    path = model_factory("llama", num_hidden_layers=4)
    for dev in (EDGE, CLOUD):
        dev.save(tmp_path / f"{dev.name}.json")
    common = [
        "partition",
        "--model",
        str(path),
        "--edge",
        str(tmp_path / "edge.json"),
        "--cloud",
        str(tmp_path / "cloud.json"),
        "--link",
        "100mbit,20ms",
    ]
    rc = main(
        [
            *common,
            "--min-cloud-throughput",
            "10",
            "-o",
            str(tmp_path / "plan.json"),
            "--plot",
            str(tmp_path / "plan.png"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode latency" in out and "min_cloud_throughput holds" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["num_layers"] == 4 and len(plan["chosen"]["cuts"]) == 1
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*common, "--max-edge-latency", "1"]) == 1
    assert "max_edge_latency fails at every cut" in capsys.readouterr().out


def test_profile_device_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "dev.json"
    assert (
        main(
            [
                "profile-device",
                "--name",
                "here",
                "--dtypes",
                "float32",
                "--threads",
                "1",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    profile = DeviceProfile.load(out)
    assert profile.name == "here" and profile.threads == 1
    assert profile.flops["float32"] > 1e8 and profile.mem_bandwidth > 1e8
    assert profile.mem_capacity > 1 << 30 and profile.op_overhead_s > 0


def _timings(name: str, per_layer, points, prompts=(8, 32, 64)) -> LayerTimings:
    """Timings generated from known per-layer costs: per_layer(batch, context) seconds."""
    from pagedllm.partition.profiles import DecodePoint, PrefillPoint

    decode = tuple(
        DecodePoint(b, c, (0.0,) + (per_layer(b, c),) * L + (0.0,), 1e-4 * b, 0.0, 1e-3)
        for b, c in points
    )
    prefill = tuple(
        PrefillPoint(p, (0.0,) + (1e-5 * p + 1e-8 * p * p,) * L + (0.0,)) for p in prompts
    )
    ref = decode[0]
    return LayerTimings(
        name, ref.batch, ref.context, prompts[-1], ref.nodes, prefill[-1].nodes,
        ref.engine, ref.prepare, ref.sample, 1, decode, prefill,
    )  # fmt: skip


def test_fitted_timings_predict_settings_that_were_not_measured():
    # fixed 0.5 ms + 0.2 ms per sequence + 2 us per (sequence, context token) per layer
    def cost(b, c):
        return 5e-4 + 2e-4 * b + 2e-6 * b * c

    points = [(1, 32), (1, 128), (4, 32), (4, 128)]
    timings = _timings("edge", cost, points)
    fit = timings.fitted()
    assert fit is not None
    assert fit.decode_s(1, 8, 512) == pytest.approx(cost(8, 512), rel=1e-6)
    assert fit.prefill_s(1, 128) == pytest.approx(1e-5 * 128 + 1e-8 * 128**2, rel=1e-6)
    graph = uniform_graph().with_timings(timings)
    partitioner = GraphPartitioner(batch_size=8, context_len=512, wire_dtype="float32")
    plan = partitioner.analyze(graph, [EDGE, CLOUD], FAST_LINK, cuts=[3])
    edge = plan.chosen.tiers[0]
    assert edge.decode_ms == pytest.approx((3 * cost(8, 512) + 8e-4 + 1e-3) * 1e3, rel=1e-6)
    # one point is not a fit: the single-setting scaling is used instead
    assert _timings("edge", cost, points[:1]).fitted() is None


def test_ties_keep_the_plan_in_use_and_noise_does_not_move_the_cut():
    same = device("edge", 1.0)  # edge and cloud alike: every cut costs the same
    plan = analyze(devices=(same, CLOUD))
    assert plan.cuts == (1,)  # the tie goes to the fewest layers on the edge
    assert any("within the 5% margin" in line for line in plan.why_not())
    kept = GraphPartitioner(wire_dtype="float32", previous=[6])
    assert kept.analyze(uniform_graph(), [same, CLOUD], FAST_LINK).cuts == (6,)
    # profiles of one machine a few percent apart never move the plan
    gen = torch.Generator().manual_seed(0)
    cuts = set()
    for _ in range(20):
        noisy = [
            device(name, 1.0 * (1 + 0.03 * (2 * torch.rand(1, generator=gen).item() - 1)))
            for name in ("edge", "cloud")
        ]
        cuts.add(analyze(devices=noisy).cuts)
    assert cuts == {(1,)}
    # a real difference beyond the margin does move it, and why_not says why
    plan = analyze(devices=(CLOUD, EDGE))  # the edge now 4x faster than the cloud
    assert plan.cuts == (9,)
    assert any("ms/token" in line and "slowest tier" in line for line in plan.why_not())

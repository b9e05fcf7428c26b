"""The partitioner's decode latency prediction, built from timings the profiler recorded on a
real model: at every cut the prediction is the recorded nodes of each tier, the parts of a
step outside the model, and the link's fixed and transfer cost, nothing else.

How close the prediction comes to the split runtime's measured step is a property of the
machine and its load, so it is measured by ``benchmarks/partition.py`` (every cut, several
links and tier ratios, predicted against measured p50 / p25), not asserted here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.partition import DeviceProfile, GraphPartitioner, LayerTimings, LinkProfile
from pagedllm.partition.graph import graph_for_model
from pagedllm.partition.partitioner import LAYOUT_BYTES_PER_SEQ, REPLY_BYTES_PER_TOKEN
from pagedllm.partition.plan import wire_bytes_per_token
from pagedllm.partition.profiler import measure_layer_timings

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=4 << 20)
SHAPE = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024)
BATCH, CONTEXT = 4, 32
CUTS = (1, 2, 3)
CPU = DeviceProfile("cpu", {"float32": 5e10}, 1e10, 8 << 30)
LINK = LinkProfile(1000, 0.2, 0.05)


@pytest.fixture(scope="module")
def recorded(model_factory, tmp_path_factory) -> tuple[str, LayerTimings]:
    """A tiny llama and its timings, profiled on this machine, saved and read back."""
    model = model_factory("llama", **SHAPE)
    threads = torch.get_num_threads()
    try:
        args = EngineArgs(model=str(model), **ENGINE)
        timings = measure_layer_timings(args, "cpu", BATCH, CONTEXT, 16, threads=1)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("timings") / "cpu.json"
    timings.save(path)
    return str(model), LayerTimings.load(path)


def predict(model: str, timings: LayerTimings | None, cut: int, link: LinkProfile = LINK):
    graph = graph_for_model(model, "float32")
    if timings is not None:
        graph = graph.with_timings(timings)
    partitioner = GraphPartitioner(batch_size=BATCH, context_len=CONTEXT, wire_dtype="float32")
    return partitioner.analyze(graph, [CPU, CPU], link, cuts=[cut]).chosen


def at_the_recorded_setting(timings: LayerTimings) -> LayerTimings:
    """The single recorded setting only (no fitted model, no wake-up penalty): then a node's
    predicted time is its recorded time, and the test can add them up by hand."""
    return dataclasses.replace(timings, decode_points=(), prefill_points=(), wake_s=())


def test_the_profile_records_every_node_and_survives_a_round_trip(recorded):
    model, timings = recorded
    graph = graph_for_model(model, "float32")
    assert (timings.batch_size, timings.context_len, timings.threads) == (BATCH, CONTEXT, 1)
    assert len(timings.decode_s) == len(graph.nodes) == SHAPE["num_hidden_layers"] + 2
    assert all(t > 0 for t in timings.decode_s[1:-1]), timings.decode_s  # every layer timed
    assert len(timings.decode_points) >= 3  # the short profile's settings, for the fit
    assert timings.fitted() is not None


@pytest.mark.parametrize("cut", CUTS)
def test_the_prediction_is_the_sum_of_the_recorded_parts(recorded, cut):
    model, timings = recorded
    timings = at_the_recorded_setting(timings)
    chosen = predict(model, timings, cut)
    edge, cloud = chosen.tiers
    nodes = timings.decode_s
    # edge: embed + layers [0, cut) + the engine around the runner + building the batch
    assert edge.decode_ms == pytest.approx(
        1e3 * (sum(nodes[: cut + 1]) + timings.engine_s + timings.prepare_s)
    )
    # cloud: layers [cut, L) + head + building the batch + sampling
    assert cloud.decode_ms == pytest.approx(
        1e3 * (sum(nodes[cut + 1 :]) + timings.prepare_s + timings.sample_s)
    )
    (link,) = chosen.links
    per_token = wire_bytes_per_token(SHAPE["hidden_size"], "float32") + REPLY_BYTES_PER_TOKEN
    per_token += LAYOUT_BYTES_PER_SEQ
    assert link.bytes_per_token == per_token
    transfer_ms = 1e3 * BATCH * per_token / (LINK.bandwidth_mbps * 1e6 / 8)
    assert link.decode_ms == pytest.approx(LINK.rtt_ms + LINK.overhead_ms + transfer_ms)
    total = edge.decode_ms + cloud.decode_ms + link.decode_ms
    assert chosen.decode_latency_ms == pytest.approx(total)
    assert chosen.tokens_per_s == pytest.approx(BATCH * 1e3 / chosen.decode_latency_ms)


@pytest.mark.parametrize("cut", CUTS)
def test_the_link_adds_its_delay_once_and_the_recorded_compute_the_rest(recorded, cut):
    """Orderings and differences that hold whatever the machine's load was while profiling:
    10 ms more RTT is 10 ms more per step; without timings the prediction is the roofline
    of the made-up device, which does not change with what was measured."""
    model, timings = recorded
    timings = at_the_recorded_setting(timings)
    near = predict(model, timings, cut)
    far = predict(model, timings, cut, dataclasses.replace(LINK, rtt_ms=LINK.rtt_ms + 10))
    assert far.decode_latency_ms - near.decode_latency_ms == pytest.approx(10.0)
    assert far.tiers == near.tiers
    slower = dataclasses.replace(timings, decode_s=tuple(2 * t for t in timings.decode_s))
    compute_ms = 1e3 * sum(timings.decode_s)
    twice = predict(model, slower, cut)
    assert twice.decode_latency_ms - near.decode_latency_ms == pytest.approx(compute_ms)
    roofline = predict(model, None, cut)
    assert roofline == predict(model, None, cut)
    assert roofline.decode_latency_ms != pytest.approx(near.decode_latency_ms)

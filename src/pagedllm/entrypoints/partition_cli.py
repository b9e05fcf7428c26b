"""``pagedllm partition | profile-device | split-worker``: plan a split, measure a device,
run the cloud tier of a plan."""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
from typing import TYPE_CHECKING

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import SUBCOMMANDS, add_engine_args, engine_args_from

if TYPE_CHECKING:
    from pagedllm.partition.profiles import LinkProfile

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _link(text: str) -> LinkProfile:
    from pagedllm.partition.profiles import LinkProfile

    try:
        return LinkProfile.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---- partition -----------------------------------------------------------------------------
def _add_partition(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--dtype", default="auto", help="weights' dtype (default: the model's)")
    p.add_argument("--edge", required=True, help="edge DeviceProfile JSON (profile-device)")
    p.add_argument("--cloud", required=True, help="cloud DeviceProfile JSON")
    p.add_argument(
        "--middle",
        action="append",
        default=[],
        help="DeviceProfile of a tier in between, "
        "in chain order (repeatable: device -> edge -> cloud)",
    )
    p.add_argument(
        "--link",
        action="append",
        type=_link,
        required=True,
        help="BANDWIDTH,RTT[,OVERHEAD], e.g. 100mbit,20ms, or a LinkProfile JSON; one for "
        "all links or one per neighbouring pair",
    )
    p.add_argument(
        "--timings",
        action="append",
        default=[],
        help="LayerTimings JSON measured on a tier's device (profile-device --model); "
        "refines that device's estimates (repeatable)",
    )
    p.add_argument(
        "--strategy", default="latency_aware", choices=["latency_aware", "throughput_aware"]
    )
    p.add_argument("--max-edge-latency", type=float, help="ms per token, end to end")
    p.add_argument("--min-cloud-throughput", type=float, help="tokens/s of the cloud tier")
    p.add_argument("--max-edge-memory", type=parse_bytes, help="bytes on the edge (2GiB ...)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per decode step")
    p.add_argument("--context-len", type=int, default=512, help="context tokens in decode")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens in prefill")
    p.add_argument(
        "--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "int8"]
    )
    p.add_argument(
        "--cut",
        type=int,
        action="append",
        default=None,
        help="evaluate this cut only instead of choosing one (one per link)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.05,
        help="placements within this fraction of the best are ties (default 0.05)",
    )
    p.add_argument(
        "--previous", default=None, help="the plan in use: its cut is kept while it ties"
    )
    p.add_argument("--output", "-o", default=None, help="write the plan JSON here")
    p.add_argument("--plot", default=None, help="draw latency/throughput per cut to FILE")


def _partition(ns: argparse.Namespace) -> int:
    from pagedllm.partition import DeviceProfile, GraphPartitioner, LayerTimings
    from pagedllm.partition.graph import graph_for_model

    args = EngineArgs() if ns.model is None else EngineArgs(model=ns.model)
    graph = graph_for_model(args.model, ns.dtype)
    for path in ns.timings:
        graph = graph.with_timings(LayerTimings.load(path))
    devices = [DeviceProfile.load(p) for p in (ns.edge, *ns.middle, ns.cloud)]
    constraints = {
        name: getattr(ns, name)
        for name in ("max_edge_latency", "min_cloud_throughput", "max_edge_memory")
        if getattr(ns, name) is not None
    }
    previous = None
    if ns.previous:
        from pagedllm.partition import PartitionPlan

        previous = PartitionPlan.load(ns.previous).cuts
    partitioner = GraphPartitioner(
        ns.strategy,
        constraints,
        ns.batch_size,
        ns.context_len,
        ns.prompt_len,
        ns.wire_dtype,
        margin=ns.margin,
        previous=previous,
    )
    links = ns.link[0] if len(ns.link) == 1 else ns.link
    plan = partitioner.analyze(graph, devices, links, cuts=ns.cut)
    print(plan.table())
    if ns.output:
        plan.save(ns.output)
        print(f"\nplan written to {ns.output}")
    if ns.plot:
        from pagedllm.partition.plot import plot_plan

        plot_plan(plan, ns.plot)
        print(f"plot written to {ns.plot}")
    return 0 if plan.feasible else 1


# ---- profile-device ------------------------------------------------------------------------
def _add_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--name",
        default=socket.gethostname(),
        help="profile name, e.g. edge or cloud (default: this machine's host name)",
    )
    p.add_argument("--output", "-o", required=True, help="DeviceProfile JSON to write")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--model", default=None, help="also time every layer of this model")
    p.add_argument("--timings-output", default=None, help="LayerTimings JSON (with --model)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)


def _profile(ns: argparse.Namespace) -> int:
    from pagedllm.partition.profiler import measure_layer_timings, profile_device

    profile = profile_device(ns.name, ns.device, tuple(ns.dtypes.split(",")), ns.threads)
    profile.save(ns.output)
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in profile.flops.items())
    print(
        f"{ns.name}: {flops}; copy {profile.mem_bandwidth / 1e9:.1f} GB/s; "
        f"{profile.op_overhead_s * 1e6:.1f} us/op; {profile.mem_capacity / 2**30:.1f} GiB "
        f"({profile.threads} threads) -> {ns.output}"
    )
    if ns.model:
        out = ns.timings_output or ns.output.replace(".json", "") + ".timings.json"
        args = EngineArgs(model=ns.model, device=ns.device)
        timings = measure_layer_timings(
            args, ns.name, ns.batch_size, ns.context_len, ns.prompt_len, threads=ns.threads
        )
        timings.save(out)
        print(
            f"per-layer timings of {ns.model}: {sum(timings.decode_s) * 1e3:.2f} ms/step -> {out}"
        )
    return 0


# ---- split-worker (the cloud tier) ---------------------------------------------------------
def run_cloud_worker(
    args: EngineArgs,
    emulate: LinkProfile | None = None,
    threads: int | None = None,
    tier: int | None = None,
    next_address: str | None = None,
) -> int:
    """Serve a tier after the edge (the last one, or ``tier``) of args.partition_config until
    interrupted."""
    import torch

    from pagedllm.partition.plan import PartitionPlan
    from pagedllm.partition.runtime import CloudWorker

    settings = args.partition_config
    if settings is None or "plan" not in settings:
        raise ValueError("the cloud tier needs --partition PLAN.json")
    if threads is not None:
        torch.set_num_threads(threads)
    num_tiers = len(PartitionPlan.load(settings["plan"]).cuts) + 1
    role = "cloud" if tier is None or tier == num_tiers - 1 else f"tier{tier}"
    args = dataclasses.replace(args, partition_config={**settings, "role": role})
    worker = CloudWorker(args.create_engine_config(), next_address)
    server = worker.serve(emulate)
    start, end = worker.tier.layers
    what = "+ head" if worker.tier.is_last else f"-> {next_address}"
    print(
        f"split worker (layers [{start}, {end}) {what}) listening on {server.address}", flush=True
    )
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


def _add_worker(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, model_positional=True)
    p.add_argument(
        "--emulate-link",
        type=_link,
        default=None,
        help="add a link's delay to every exchange: BANDWIDTH,RTT, e.g. 100mbit,20ms",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument(
        "--tier",
        type=int,
        default=None,
        help="this worker's position in a chain of more than two tiers (1 = after the edge; "
        "default: the last)",
    )
    p.add_argument(
        "--next-address", default=None, help="a tier in between: the next tier's HOST:PORT"
    )


def _worker(ns: argparse.Namespace) -> int:
    return run_cloud_worker(
        engine_args_from(ns), ns.emulate_link, ns.threads, ns.tier, ns.next_address
    )


_COMMANDS = {
    "partition": (_add_partition, _partition, "Choose where to cut a model between tiers."),
    "profile-device": (_add_profile, _profile, "Measure this machine as a tier's device."),
    "split-worker": (_add_worker, _worker, "Run the cloud tier of a partition plan."),
}


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    add, handler, description = _COMMANDS[name]
    p = subparsers.add_parser(name, help=SUBCOMMANDS[name][1], description=description)
    add(p)
    p.set_defaults(func=handler)
    return p

"""Edge/cloud split inference: plan a cut, run the plan for real, compare with the prediction.

The edge is this process limited to one torch thread; the cloud is a split-worker process
with two; the link (20 ms RTT, 100 Mbit/s by default) is emulated in the transport. For each
model: profile both tiers on this machine (probes + measured per-layer timings), plan with
the seed constraints (max_edge_latency 150 ms, min_cloud_throughput 32 tok/s), run the
chosen cut (and any --cuts) through the split runtime, and run the unsplit engine with one
thread (edge alone) and two (cloud alone, no link) as baselines in the same script.

    python benchmarks/partition.py                       # the demo and the 125M model
    python benchmarks/partition.py --models bench --cuts 3 9 --steps 24
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402

from pagedllm.config import EngineArgs, default_model_path  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.partition import (  # noqa: E402
    DeviceProfile,
    GraphPartitioner,
    LayerTimings,
    LinkProfile,
    PartitionPlan,
)
from pagedllm.partition.graph import graph_for_model  # noqa: E402
from pagedllm.partition.plot import plot_plan  # noqa: E402
from pagedllm.partition.transport import measure_overhead_ms  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

SEED_CONSTRAINTS = {"max_edge_latency": 150.0, "min_cloud_throughput": 32.0}


@dataclass
class Measured:
    ms_per_token: float  # median decode step
    ms_p25: float  # lower-quartile decode step: the steps no other process interrupted
    tokens_per_s: float  # generated tokens over the decode phase's wall time


def decode_run(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> Measured:
    """batch requests of prompt_len tokens; time `steps` decode steps after the prefill.
    Runs on a thread of its own, as the server's engine thread does (see the profiler)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_decode_run, engine, batch, prompt_len, steps).result()


def _decode_run(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> Measured:
    vocab = engine.config.model.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm-up decode step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request([f"r{i}" for i in range(batch)])
    p25 = statistics.quantiles(times, n=4)[0]
    return Measured(statistics.median(times) * 1e3, p25 * 1e3, batch * steps / sum(times))


def engine_args(model: str, batch: int, context: int) -> EngineArgs:
    return EngineArgs(
        model=model,
        max_num_seqs=max(batch, 1),
        kv_cache_memory_bytes=256 << 20,
        max_model_len=max(context * 2, 256),
    )


def start_worker(model: str, plan: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "split-worker", model,
        "--partition", str(plan), "--partition-address", "127.0.0.1:0",
        "--threads", str(args.cloud_threads), "--emulate-link", args.link,
        "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len",
        str(max(args.context_len * 2, 256)), "--max-num-seqs", str(max(args.batch_size, 1)),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.rsplit(" ", 1)[1].strip()
    raise RuntimeError("the cloud worker did not start")


def run_split(model: str, plan: Path, args: argparse.Namespace) -> Measured:
    proc, address = start_worker(model, plan, args)
    try:
        split = dataclasses.replace(
            engine_args(model, args.batch_size, args.context_len),
            partition=str(plan),
            partition_address=address,
        )
        engine = LLMEngine.from_engine_args(split, skip_tokenizer_init=True)
        result = decode_run(engine, args.batch_size, args.context_len, args.steps)
        engine.shutdown()
        return result
    finally:
        proc.kill()
        proc.wait()


def run_unsplit(model: str, threads: int, args: argparse.Namespace) -> Measured:
    """The whole model in a fresh process with `threads` threads (as a tier would run)."""
    cmd = [sys.executable, __file__, "--unsplit", str(threads), "--model-path", model,
           "--batch-size", str(args.batch_size), "--context-len", str(args.context_len),
           "--steps", str(args.steps)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    ms, p25, tps = out.strip().splitlines()[-1].split()[1:]
    return Measured(float(ms), float(p25), float(tps))


def profile_tier(name: str, threads: int, model: str, out: Path, args: argparse.Namespace) -> None:
    """`pagedllm profile-device` in a fresh process: probes plus the model's layer timings."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "profile-device", "--name", name,
           "--threads", str(threads), "--dtypes", args.dtype, "--model", model,
           "--batch-size", str(args.batch_size), "--context-len", str(args.context_len),
           "-o", str(out / f"{name}.json"),
           "--timings-output", str(out / f"{name}.timings.json")]  # fmt: skip
    print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def plan_model(model: str, out: Path, args: argparse.Namespace) -> PartitionPlan:
    """Profile both tiers on this machine and plan with the seed constraints."""
    base = engine_args(model, args.batch_size, args.context_len)
    args.dtype = base.create_engine_config().model.dtype
    graph = graph_for_model(model, args.dtype)
    devices = []
    for name, threads in (("edge", args.edge_threads), ("cloud", args.cloud_threads)):
        profile_tier(name, threads, model, out, args)
        devices.append(DeviceProfile.load(out / f"{name}.json"))
        graph = graph.with_timings(LayerTimings.load(out / f"{name}.timings.json"))
    edge, cloud = devices
    link = LinkProfile.parse(args.link)
    hidden = graph.hidden_size * args.batch_size * 2
    link = LinkProfile(link.bandwidth_mbps, link.rtt_ms, measure_overhead_ms(hidden))
    context = args.context_len + args.steps // 2  # the mean context over the measured steps
    partitioner = GraphPartitioner(
        args.strategy, SEED_CONSTRAINTS, args.batch_size, context, 128, args.wire_dtype
    )
    plan = partitioner.analyze(graph, [edge, cloud], link)
    plan.save(out / "plan.json")
    plot_plan(plan, out / "plan.png")
    args.model_cuts = [c for c in args.cuts if 0 < c < graph.num_layers]
    for cut in args.model_cuts:
        partitioner.analyze(graph, [edge, cloud], link, cuts=[cut]).save(out / f"cut{cut}.json")
    return plan


def bench_model(label: str, model: str, args: argparse.Namespace) -> list[str]:
    out = Path(args.out) / label
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_model(model, out, args)
    print(plan.table(), flush=True)
    cloud_alone = run_unsplit(model, args.cloud_threads, args)
    edge_alone = run_unsplit(model, args.edge_threads, args)
    rows = [
        f"| {label} | unsplit, {args.cloud_threads} thread(s) (cloud alone, no link) | - | "
        f"{cloud_alone.ms_per_token:.1f} | {cloud_alone.ms_p25:.1f} | - | "
        f"{cloud_alone.tokens_per_s:.1f} | 1.00 |",
        f"| {label} | unsplit, {args.edge_threads} thread(s) (edge alone) | - | "
        f"{edge_alone.ms_per_token:.1f} | {edge_alone.ms_p25:.1f} | - | "
        f"{edge_alone.tokens_per_s:.1f} | "
        f"{edge_alone.tokens_per_s / cloud_alone.tokens_per_s:.2f} |",
    ]
    runs = [(f"cut {plan.cuts[0]} (chosen)", out / "plan.json")]
    runs += [(f"cut {c}", out / f"cut{c}.json") for c in args.model_cuts if c != plan.cuts[0]]
    for name, plan_file in runs:
        predicted = PartitionPlan.load(plan_file).chosen
        got = run_split(model, plan_file, args)
        ms = predicted.decode_latency_ms
        p50_err, p25_err = ms / got.ms_per_token - 1, ms / got.ms_p25 - 1
        err = f"{p50_err:+.0%} / {p25_err:+.0%}"
        rows.append(
            f"| {label} | split {name} | {ms:.1f} | {got.ms_per_token:.1f} | {got.ms_p25:.1f} | "
            f"{err} | {got.tokens_per_s:.1f} | "
            f"{got.tokens_per_s / cloud_alone.tokens_per_s:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "bench"])
    parser.add_argument("--cuts", type=int, nargs="*", default=[], help="also run these cuts")
    parser.add_argument("--strategy", default="latency_aware")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--edge-threads", type=int, default=1)
    parser.add_argument("--cloud-threads", type=int, default=2)
    parser.add_argument("--link", default="100mbit,20ms")
    parser.add_argument("--wire-dtype", default="bfloat16")
    parser.add_argument("--out", default="bench_out/partition")
    parser.add_argument("--unsplit", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.unsplit is not None:  # a baseline, in its own process
        torch.set_num_threads(args.unsplit)
        engine = LLMEngine.from_engine_args(
            engine_args(args.model_path, args.batch_size, args.context_len),
            skip_tokenizer_init=True,
        )
        got = decode_run(engine, args.batch_size, args.context_len, args.steps)
        print(f"RESULT {got.ms_per_token} {got.ms_p25} {got.tokens_per_s}")
        return
    torch.set_num_threads(args.edge_threads)  # this process is the edge
    models = {"demo": default_model_path(), "bench": str(build_bench_model(default_model_dir()))}
    rows = [
        "| model | run | predicted ms/token | measured p50 | measured p25 | error vs p50 / p25 "
        "| tok/s | tok/s vs cloud alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in args.models:
        if not Path(models[label], "config.json").exists():
            print(f"skipping {label}: no model at {models[label]}")
            continue
        rows += bench_model(label, models[label], args)
    print(
        f"\n{machine()}; edge {args.edge_threads} thread(s), cloud {args.cloud_threads}, "
        f"link {args.link}, batch {args.batch_size}, context {args.context_len}; "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()

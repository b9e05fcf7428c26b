"""Edge/cloud split over an emulated network: every cut measured, the plan's choice and
predictions checked against the measurements, and the pipelined runtime's throughput.

The network (pagedllm.partition.netem): the cloud workers run in a network namespace joined
to the edge's by a veth pair whose rate is shaped by tc tbf; the edge (this process)
reaches each worker through the delaying TCP proxy, which adds the RTT. Link settings are
changed at run time (tc and the proxy), so each (model, tier ratio, cut) starts one worker.
Without root / iproute2 the delay is slept in the transport instead (said in the output).

For each model and tier ratio (edge threads / cloud threads): profile both tiers (the short
multi-point profile, each in a fresh process with its thread count), measure the
transport's own cost per exchange over the real path, then for each link setting predict
every cut, plan (latency_aware, 5% tie margin) and measure every cut's decode step (batch 1,
context --context-len). Profiles are cached under --out (delete it to re-profile). Finally,
pipelined throughput: 8 concurrent requests with pipeline depth 2 against depth 1, both at
the cut a throughput-aware plan picks for micro-batches of 8 / depth.

    python benchmarks/partition.py                                  # everything
    python benchmarks/partition.py --models demo --links 1gbit,2ms --ratios 1:2
    python benchmarks/partition.py --models bench --cuts 2 6 10 --no-pipeline
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
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
    netem,  # noqa: E402
)
from pagedllm.partition.adapt import LinkMonitor, LinkSnapshot  # noqa: E402
from pagedllm.partition.graph import graph_for_model  # noqa: E402
from pagedllm.partition.plot import plot_plan  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

LINKS = ["1gbit,2ms", "100mbit,20ms", "10mbit,80ms"]
PIPELINE_REQUESTS = 8
KV_BYTES = 64 << 20


@dataclass
class Measured:
    p50: float  # median decode step, ms
    p25: float  # lower quartile: the steps no other process interrupted


@dataclass
class Worker:
    process: subprocess.Popen
    address: str  # where the edge connects (the proxy, or the worker itself)
    proxy: netem.DelayProxy | None

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.process.kill()
        self.process.wait()


def engine_args(model: str, batch: int, context: int, **extra) -> EngineArgs:
    return EngineArgs(
        model=model,
        max_num_seqs=max(batch, 8),
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=max(context * 2, 256),
        **extra,
    )


def on_thread(fn, *args):
    """Run fn on a thread of its own, as the server's engine thread does (see the profiler)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def decode_steps(engine: LLMEngine, prompt_len: int, steps: int) -> list[float]:
    vocab = engine.config.model.hf_config.vocab_size
    ids = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    engine.add_request("r", ids.tolist(), params)
    while engine.scheduler.waiting or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    engine.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    engine.abort_request("r")
    return times


def measured(times: list[float]) -> Measured:
    return Measured(statistics.median(times), statistics.quantiles(times, n=4)[0])


def concurrent_tokens_per_s(
    engine: LLMEngine, n: int, prompt_len: int, tokens: int, seed: int
) -> float:
    """n requests at once; a seed of its own per run, so no run reuses another's prompts
    through the prefix cache."""
    vocab = engine.config.model.hf_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(
            f"c{i}", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params
        )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n * tokens / (time.perf_counter() - start)


def profile(
    model: str, threads: int, out: Path, args: argparse.Namespace
) -> tuple[DeviceProfile, LayerTimings]:
    name = f"t{threads}"
    path = out / f"{name}.json"
    if not path.exists():
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "profile-device", "--name", name,
               "--threads", str(threads), "--dtypes", "float32", "--model", model,
               "--batch-size", "1", "--context-len", str(args.context_len + args.steps // 2),
               "-o", str(path), "--timings-output", str(out / f"{name}.timings.json")]  # fmt: skip
        subprocess.run(cmd, capture_output=True, text=True, check=True)
    return DeviceProfile.load(path), LayerTimings.load(out / f"{name}.timings.json")


def start_worker(model: str, plan: Path, threads: int, net, args) -> Worker:
    address = f"{net.cloud_ip}:0" if net is not None else "127.0.0.1:0"
    cmd = [*(net.exec_prefix() if net is not None else []), sys.executable, "-m",
           "pagedllm.entrypoints.cli", "split-worker", model, "--partition", str(plan),
           "--partition-address", address, "--threads", str(threads),
           "--kv-cache-memory-bytes", str(KV_BYTES),
           "--max-model-len", str(max(args.context_len * 2, 256)),
           "--max-num-seqs", "8"]  # fmt: skip
    if net is None:
        cmd += ["--emulate-link", args.current_link]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            worker_address = line.rsplit(" ", 1)[1].strip()
            break
    else:
        raise RuntimeError("the cloud worker did not start")
    if net is None:
        return Worker(proc, worker_address, None)
    proxy = netem.DelayProxy(worker_address, net.edge_ns)
    return Worker(proc, proxy.address, proxy)


def set_link(text: str, net, worker: Worker) -> None:
    link = LinkProfile.parse(text)
    if net is not None:
        net.set_rate(link.bandwidth_mbps)
        worker.proxy.set(rtt_ms=link.rtt_ms)


def monitored_steps(engine: LLMEngine, args) -> tuple[list[float], LinkSnapshot]:
    """--steps decode steps' times, and the runtime's LinkMonitor medians over just them:
    edge and cloud compute, and the link's share (round trip less the cloud's compute:
    encoding, the RPC, the proxy and decoding on both sides)."""
    engine.executor.monitor = LinkMonitor(window=args.steps)
    times = on_thread(decode_steps, engine, args.context_len, args.steps)
    return times, engine.executor.monitor.snapshot()


def planner(args) -> GraphPartitioner:
    """The partitioner of every plan here: latency-aware, batch 1, mid-run context."""
    return GraphPartitioner(
        "latency_aware", None, 1, args.context_len + args.steps // 2, args.context_len,
        args.wire_dtype,
    )  # fmt: skip


def emulated_link(text: str, rtt_ms: float) -> LinkProfile:
    """The link setting with the RTT the emulated link really adds (the proxy's timers
    overshoot a little)."""
    return dataclasses.replace(LinkProfile.parse(text), rtt_ms=rtt_ms)


def measured_link(link: LinkProfile, overhead: dict[int, float]) -> LinkProfile:
    """A link with the transport's overhead measured over the real path (median over the
    cuts' workers)."""
    return dataclasses.replace(link, overhead_ms=statistics.median(overhead.values()))


def cut_plan(graph, devices, link, cut: int, args) -> object:
    return planner(args).analyze(graph, devices, link, cuts=[cut])


def bench_ratio(label: str, model: str, edge_t: int, cloud_t: int, net, args) -> dict:
    out = Path(args.out) / label
    out.mkdir(parents=True, exist_ok=True)
    edge_dev, edge_tim = profile(model, edge_t, out, args)
    cloud_dev, cloud_tim = profile(model, cloud_t, out, args)
    edge_dev = dataclasses.replace(edge_dev, name="edge")
    cloud_dev = dataclasses.replace(cloud_dev, name="cloud")
    graph = graph_for_model(model, "float32")
    graph = graph.with_timings(dataclasses.replace(edge_tim, device="edge"))
    graph = graph.with_timings(dataclasses.replace(cloud_tim, device="cloud"))
    cuts = [c for c in (args.cuts or range(1, graph.num_layers)) if 0 < c < graph.num_layers]
    torch.set_num_threads(edge_t)
    results = {"edge_threads": edge_t, "cloud_threads": cloud_t, "links": {}}
    overhead: dict[int, list[float]] = {cut: [] for cut in cuts}
    rtt: dict[str, list[float]] = {text: [] for text in args.links}  # as pings see each link
    times: dict[tuple[str, int], list[float]] = {}  # (link, cut) -> step times, every pass
    parts: dict[tuple[str, int], list[list[float]]] = {}  # measured edge / cloud / link
    # the machine's speed drifts over minutes: the passes visit the cuts in turn, forward
    # then backward, so a drift weighs on every cut alike
    for p in range(args.passes):
        for cut in cuts if p % 2 == 0 else cuts[::-1]:  # one worker at a time
            with split_engine(model, graph, [edge_dev, cloud_dev], cut, cloud_t, net, out,
                              args) as (engine, worker):  # fmt: skip
                # the transport's own cost per exchange over the real path, no added delay
                set_link("10000mbit,0ms", net, worker)
                overhead[cut].append(monitored_steps(engine, args)[1].link_ms)
                undelayed = statistics.median(on_thread(engine.executor.ping_ms, 10))
                for text in args.links:
                    set_link(text, net, worker)
                    # the emulated link's own RTT: empty pings through it, less undelayed ones
                    pings = on_thread(engine.executor.ping_ms, 10)
                    rtt[text].append(statistics.median(pings) - undelayed)
                    got, seen = monitored_steps(engine, args)
                    times.setdefault((text, cut), []).extend(got)
                    parts.setdefault((text, cut), []).append(
                        [seen.edge_ms, seen.remote_ms, seen.link_ms]
                    )
                    print(f"{label} pass {p} {text} cut {cut}: measured p50 "
                          f"{statistics.median(got):.1f}", flush=True)  # fmt: skip
    overhead_ms = {cut: statistics.mean(v) for cut, v in overhead.items()}
    links = {text: emulated_link(text, statistics.median(rtt[text])) for text in args.links}
    results["rtt_ms"] = {text: link.rtt_ms for text, link in links.items()}
    rows: dict[str, dict[int, dict]] = {text: {} for text in args.links}
    for text in args.links:
        for cut in cuts:
            link = dataclasses.replace(links[text], overhead_ms=overhead_ms[cut])
            predicted = cut_plan(graph, [edge_dev, cloud_dev], link, cut, args).chosen
            got = measured(times[text, cut])
            edge, cloud = predicted.tiers
            rows[text][cut] = {
                "predicted": predicted.decode_latency_ms,
                "p50": got.p50,
                "p25": got.p25,
                # the parts, predicted and measured (mean over the passes of their medians)
                "predicted_parts": [edge.decode_ms, cloud.decode_ms,
                                    predicted.links[0].decode_ms],
                "measured_parts": [statistics.mean(c) for c in zip(*parts[text, cut])],
            }  # fmt: skip
    for text in args.links:
        link = measured_link(links[text], overhead_ms)
        plan = planner(args).analyze(graph, [edge_dev, cloud_dev], link)
        (out / f"plan-{text.replace(',', '_')}.txt").write_text(plan.table() + "\n")
        plot_plan(plan, out / f"plan-{text.replace(',', '_')}.png")
        chosen = plan.cuts[0] if plan.cuts[0] in cuts else None
        results["links"][text] = {"chosen": chosen, "planned": plan.cuts[0], "cuts": rows[text]}
    if args.pipeline:
        text = args.pipeline_link
        nominal = links.get(text) or LinkProfile.parse(text)
        link = measured_link(nominal, overhead_ms)
        # the cut a throughput plan picks for the micro-batches the pipeline runs
        pipelined = GraphPartitioner(
            "throughput_aware", None, PIPELINE_REQUESTS // args.pipeline_depths[0],
            args.context_len, args.context_len, args.wire_dtype,
        )  # fmt: skip
        cut = pipelined.analyze(graph, [edge_dev, cloud_dev], link).cuts[0]
        with split_engine(model, graph, [edge_dev, cloud_dev], cut, cloud_t, net, out, args) as (
            engine,
            worker,
        ):
            set_link(text, net, worker)
            results["pipeline"] = pipeline_ratio(engine, text, cut, args)
    return results


@contextlib.contextmanager
def split_engine(model, graph, devices, cut, cloud_t, net, out, args):
    plan_file = out / f"cut{cut}.json"
    cut_plan(graph, devices, LinkProfile(1000, 1), cut, args).save(plan_file)
    args.current_link = args.links[0]
    worker = start_worker(model, plan_file, cloud_t, net, args)
    engine = None
    try:
        # each cut is measured where it is: no re-planning while the benchmark runs
        split = engine_args(model, 1, args.context_len, partition_config={
            "plan": str(plan_file), "address": worker.address, "replan_interval": 0,
        })  # fmt: skip
        engine = LLMEngine.from_engine_args(split, skip_tokenizer_init=True)
        yield engine, worker
    finally:
        if engine is not None:
            engine.shutdown()
        worker.close()


def pipeline_ratio(engine, text: str, cut: int, args) -> dict:
    """8 concurrent requests at the pipeline link's planned cut: each of --pipeline-depths
    against depth 1 (the ratio is the first depth's). One warm-up run, then
    --pipeline-rounds rounds visiting the depths in turn, each run on new prompts; the best
    run of each depth counts. Per depth also the medians of what one step (micro-batch)
    cost: the edge's compute, the cloud's, and the link (round trip minus the cloud)."""
    n, tokens = PIPELINE_REQUESTS, args.pipeline_tokens
    depths = (1, *args.pipeline_depths)
    executor = engine.executor
    seeds = iter(range(1, 1000))
    steps: dict[int, dict] = {}  # depth -> the medians of one step's parts, its last run

    def run(depth: int) -> float:
        executor.partition = dataclasses.replace(executor.partition, pipeline_depth=depth)
        executor.monitor = LinkMonitor(window=256)
        got = on_thread(concurrent_tokens_per_s, engine, n, args.context_len // 2, tokens,
                        next(seeds))  # fmt: skip
        seen = executor.monitor.snapshot()
        steps[depth] = {"edge_ms": seen.edge_ms, "cloud_ms": seen.remote_ms,
                        "link_ms": seen.link_ms}  # fmt: skip
        return got

    run(1)  # warm-up
    got = {d: run(d) for d in depths}
    for _ in range(args.pipeline_rounds - 1):
        for d in depths:
            got[d] = max(got[d], run(d))
    executor.partition = dataclasses.replace(executor.partition, pipeline_depth=1)
    return {
        "link": text,
        "cut": cut,
        "unpipelined": got[1],
        "pipelined": got[args.pipeline_depths[0]],
        "ratio": got[args.pipeline_depths[0]] / got[1],
        "by_depth": got,
        "step_ms": steps,
    }


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(all_results: dict, args, network: str) -> str:
    lines = [
        f"{machine()}; network: {network}; batch 1, context {args.context_len}, "
        f"{args.steps} decode steps per run; load average at the end {os.getloadavg()[0]:.1f}",
        "",
        "| model | edge/cloud threads | link | cut | predicted ms | measured p50 | p25 "
        "| error vs p50 | chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for label, ratios in all_results.items():
        for ratio, res in ratios.items():
            for text, link in res["links"].items():
                rows = link["cuts"]
                best = min(rows, key=lambda c: rows[c]["p50"])
                chosen = link["chosen"]
                if chosen is None:
                    summary.append(f"| {label} | {ratio} | {text} | {link['planned']} (not run) "
                                   "| - | - | - | - | - |")  # fmt: skip
                    chosen = -1
                for cut, r in rows.items():
                    err = r["predicted"] / r["p50"] - 1
                    mark = "chosen" if cut == chosen else ("best" if cut == best else "")
                    lines.append(
                        f"| {label} | {ratio} | {text} | {cut} | {r['predicted']:.1f} | "
                        f"{r['p50']:.1f} | {r['p25']:.1f} | {err:+.0%} | {mark} |"
                    )
                if chosen == -1:
                    continue
                gap = rows[chosen]["p50"] / rows[best]["p50"] - 1
                worst = max(abs(r["predicted"] / r["p50"] - 1) for r in rows.values())
                worst25 = max(abs(r["predicted"] / r["p25"] - 1) for r in rows.values())
                summary.append(
                    f"| {label} | {ratio} | {text} | {chosen} | {best} | {gap:+.1%} "
                    f"| {yes(gap <= 0.10)} | {worst:.0%} / {worst25:.0%} "
                    f"| {yes(worst <= 0.15)} / {yes(worst25 <= 0.15)} |"
                )
            if "pipeline" in res:
                p = res["pipeline"]
                summary.append(
                    f"| {label} | {ratio} | pipelined, 8 requests, {p['link']}, cut {p['cut']}: "
                    f"{p['unpipelined']:.1f} -> {p['pipelined']:.1f} tok/s, "
                    f"**{p['ratio']:.2f}x**; by depth: "
                    + ", ".join(f"{d}: {v:.1f}" for d, v in p["by_depth"].items())
                    + "; per step edge / cloud / link ms: "
                    + ", ".join(
                        f"{d}: {m['edge_ms']:.1f} / {m['cloud_ms']:.1f} / {m['link_ms']:.1f}"
                        for d, m in p["step_ms"].items()
                    )
                    + " |||||||"
                )
    head = [
        "| model | edge/cloud threads | link | chosen cut | best measured | chosen vs best "
        "| within 10% | worst prediction error vs p50 / p25 | all within 15% (p50 / p25) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join([*lines[:2], *head, *summary, "", *lines[2:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "bench"])
    parser.add_argument("--links", nargs="+", default=LINKS)
    parser.add_argument("--ratios", nargs="+", default=["1:2", "1:1"], help="EDGE:CLOUD threads")
    parser.add_argument("--cuts", type=int, nargs="*", default=[], help="only these cuts")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--passes", type=int, default=2, help="passes over the cuts, alternating direction"
    )
    parser.add_argument("--wire-dtype", default="bfloat16")
    parser.add_argument("--no-pipeline", dest="pipeline", action="store_false")
    parser.add_argument("--pipeline-tokens", type=int, default=16)
    parser.add_argument(
        "--pipeline-depths",
        type=int,
        nargs="+",
        default=[2],
        help="pipeline depths measured against depth 1; the first one is reported (2)",
    )
    parser.add_argument(
        "--pipeline-rounds", type=int, default=3, help="rounds over the depths (best counts)"
    )
    parser.add_argument(
        "--pipeline-link",
        default="100mbit,20ms",
        help="link of the pipelined-throughput run, at its planned cut (default: the "
        "100 Mbit/s, 20 ms reference link)",
    )
    parser.add_argument("--out", default="bench_out/partition")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM runs the clean-up (workers, proxies, namespaces) like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    models = {"demo": default_model_path(), "bench": str(build_bench_model(default_model_dir()))}
    reason = netem.unavailable()
    network = "namespaces + veth + tbf + delaying proxy"
    if reason is not None:
        network = f"delay slept in the transport ({reason}); links after the first are not applied"
        print(f"no emulated network: {reason}", flush=True)
    results: dict = {}
    with netem.EmulatedNetwork() if reason is None else contextlib.nullcontext() as net:
        for label in args.models:
            model = models[label]
            for ratio in args.ratios:
                edge_t, cloud_t = map(int, ratio.split(":"))
                results.setdefault(label, {})[ratio] = bench_ratio(
                    f"{label}-{edge_t}-{cloud_t}", model, edge_t, cloud_t, net, args
                )
                # what is done so far, in case a long run is cut short
                print(report({label: {ratio: results[label][ratio]}}, args, network), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    print(report(results, args, network))


if __name__ == "__main__":
    main()

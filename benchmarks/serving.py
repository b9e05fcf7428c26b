"""Online serving benchmark, like ``vllm bench serve``: Poisson arrivals against a live server.

For each request rate, requests arrive as a Poisson process (exponential gaps; ``inf`` sends
them all at once) and stream from /v1/completions. Per rate it reports request throughput,
output tokens/s and TTFT / TPOT / ITL / end-to-end latency percentiles, as ratios to an
unloaded baseline (the same requests sent one at a time). Prompts are random token ids drawn
from the server's own tokenization of a text, of a fixed length; outputs have a fixed length
(``ignore_eos``), so the workload does not depend on the weights. The client is ``pagedllm
bench serve``'s (pagedllm/entrypoints/bench_serve.py), which measures one rate.

    python benchmarks/serving.py --model models/pagedllm-demo           # starts a server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000       # a running server
    python benchmarks/serving.py --request-rates 1 4 inf --num-prompts 32 --plot out.png

Side by side with llama.cpp (``--llama-server PATH --gguf FILE``): after pagedllm's server,
llama-server (one slot per request, all cores) gets the same prompts and the same arrivals,
and a last table sets throughput, p99 TTFT and p99 ITL of the two next to each other:

    python benchmarks/serving.py --model bench_out/llama-125m \
        --server-args "--dtype float32 --quantization int8" --request-rates 1 2 4 \
        --llama-server /work/llama-peer/bin/llama-server \
        --gguf /work/llama-peer/gguf/llama-125m-q8_0.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from pagedllm.config import default_model_path  # noqa: E402
from pagedllm.entrypoints.bench_serve import (  # noqa: E402
    Target,
    make_prompts,
    run_rate,
    run_sequential,
    summarize,
)


# ---- the server ---------------------------------------------------------------------------
def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``pagedllm serve MODEL --port 0`` in a subprocess; returns it and its base URL."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port=0"]
    cmd += ["--uvicorn-log-level=warning", "--disable-log-stats", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = []
    for line in proc.stdout:
        banner.append(line)
        match = re.search(r"URL\s+(http://\S+)/v1", line)
        if match:
            print("".join(banner[-3:]), end="")
            wait_healthy(match[1], proc)
            return proc, match[1]
    raise RuntimeError("the server exited:\n" + "".join(banner))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


# ---- reporting ----------------------------------------------------------------------------
def print_table(rows: list[dict], baseline: dict) -> str:
    head = (
        "| rate (req/s) | done | req/s | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
        "| ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | E2E p50 / unloaded |"
    )
    lines = [head, "|" + "---|" * 9]

    def trio(row: dict, key: str) -> str:
        return "/".join(f"{row[f'{key}_p{q}_ms']:.0f}" for q in (50, 90, 99))

    for row in [baseline, *rows]:
        rate = "1 at a time" if row is baseline else f"{row['rate']:g}"
        ratio = row["e2e_p50_ms"] / baseline["e2e_p50_ms"]
        lines.append(
            f"| {rate} | {row['completed']}/{row['completed'] + row['failed']} "
            f"| {row['req_per_s']:.2f} | {row['out_tok_per_s']:.1f} | {trio(row, 'ttft')} "
            f"| {trio(row, 'tpot')} | {trio(row, 'itl')} | {trio(row, 'e2e')} | {ratio:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    return table


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rows if math.isfinite(r["rate"])]
    rates = [r["rate"] for r in finite]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, label) in zip(axes, [("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")]):
        for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            ax.plot(rates, [r[f"{name}_p{q}_ms"] for r in finite], style, label=f"p{q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def offline_throughput(model: str, server_args: str, prompts: list[list[int]], out: int) -> float:
    """Output tok/s of the offline LLM on the same requests, all at once (the upper bound)."""
    from pagedllm.entrypoints.cli import add_engine_args, engine_args_from
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(server_args.split())
    ns.model = model
    llm = LLM.from_engine_args(engine_args_from(ns))
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--base-url", help="a running server (http://host:port)")
    where.add_argument("--model", help="start `pagedllm serve MODEL` (default: the demo model)")
    ap.add_argument("--server-args", default="", help="extra `pagedllm serve` flags, quoted")
    ap.add_argument("--request-rates", nargs="+", type=float, default=[1, 2, 4, 8, math.inf])
    ap.add_argument("--num-prompts", type=int, default=48, help="requests per rate")
    ap.add_argument("--baseline-prompts", type=int, default=8, help="requests sent one by one")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=Path("benchmarks/results/serving.png"))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--llama-server", type=Path, default=None, help="also run llama-server")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF llama-server serves")
    ap.add_argument("--llama-threads", type=int, default=None, help="default: all cores")
    ap.add_argument(
        "--offline-baseline",
        action="store_true",
        help="with --model: after the server stops, run the same requests through the offline "
        "LLM and report served / offline throughput",
    )
    args = ap.parse_args()
    if args.llama_server and args.gguf is None:
        ap.error("--llama-server needs --gguf")
    return args


def measure(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, list]:
    """The unloaded baseline and one row per request rate against the server at url."""
    target = Target(url)
    asyncio.run(run_sequential(target, prompts[:2], args.output_len))  # warm-up
    start = time.perf_counter()
    base = asyncio.run(run_sequential(target, prompts[: args.baseline_prompts], args.output_len))
    baseline = summarize(0.0, base, time.perf_counter() - start)
    rows = []
    for i, rate in enumerate(args.request_rates):
        run = run_rate(target, prompts, args.output_len, rate, args.seed + i)
        results, seconds = asyncio.run(run)
        rows.append(summarize(rate, results, seconds))
        errors = {r.error for r in results if not r.ok}
        print(f"rate {rate:g}: {rows[-1]['completed']} done in {seconds:.1f} s {errors or ''}")
    print_table(rows, baseline)
    return baseline, rows


def measure_llama(prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, list]:
    """The same requests and arrivals against llama.cpp's server (one slot per request)."""
    from compare import LlamaServer

    ctx = args.input_len + args.output_len + 16
    threads = args.llama_threads or os.cpu_count() or 1
    with LlamaServer(args.llama_server, args.gguf, threads, args.num_prompts, ctx) as server:
        print(f"\nllama.cpp server ({args.gguf.name}): {server.url}")
        return measure(server.url, prompts, args)


def side_by_side(ours: list[dict], theirs: list[dict]) -> None:
    print("\n| rate | out tok/s pagedllm / llama.cpp | p99 TTFT ms | p99 ITL ms | p50 TTFT ms |")
    print("|---|---|---|---|---|")
    for a, b in zip(ours, theirs):
        print(
            f"| {a['rate']:g} | {a['out_tok_per_s']:.1f} / {b['out_tok_per_s']:.1f} "
            f"| {a['ttft_p99_ms']:.0f} / {b['ttft_p99_ms']:.0f} "
            f"| {a['itl_p99_ms']:.0f} / {b['itl_p99_ms']:.0f} "
            f"| {a['ttft_p50_ms']:.0f} / {b['ttft_p50_ms']:.0f} |"
        )


def main() -> None:
    args = parse_args()
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args.model or default_model_path(), args.server_args.split())
    try:
        prompts = make_prompts(Target(url), args.num_prompts, args.input_len, args.seed)
        print(f"machine: {machine()}\nserver: {url}")
        print(f"{args.num_prompts} requests per rate, {args.input_len} in / {args.output_len} out")
        baseline, rows = measure(url, prompts, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    report = {"baseline": baseline, "rows": rows}
    if args.llama_server:
        llama_base, llama_rows = measure_llama(prompts, args)
        report["llama.cpp"] = {"baseline": llama_base, "rows": llama_rows}
        side_by_side(rows, llama_rows)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        title = f"{args.input_len} in / {args.output_len} out tokens, {args.num_prompts} req"
        plot(rows, args.plot, f"Latency vs request rate ({title})")
    if args.offline_baseline and proc is not None:
        model = args.model or default_model_path()
        offline = offline_throughput(model, args.server_args, prompts, args.output_len)
        best = max(rows, key=lambda r: r["out_tok_per_s"])
        print(
            f"offline LLM, same {len(prompts)} requests at once: {offline:.1f} out tok/s; "
            f"best served rate ({best['rate']:g} req/s): {best['out_tok_per_s']:.1f} out tok/s "
            f"= {best['out_tok_per_s'] / offline:.2f}x offline"
        )


if __name__ == "__main__":
    main()

"""``pagedllm bench latency`` and ``pagedllm bench throughput``: vLLM's offline benchmarks;
``pagedllm bench serve`` measures a running server (entrypoints/bench_serve.py).

latency: one batch of ``--batch-size`` prompts of ``--input-len`` tokens, each generating
``--output-len`` tokens, run ``--num-iters`` times after ``--num-iters-warmup``; prints the
batch's mean latency and its percentiles (``vllm bench latency``).

throughput: ``--num-prompts`` such requests given at once; prints requests/s, total tokens/s
and output tokens/s (``vllm bench throughput`` on its random dataset).

Prompts are random token ids of the model's vocabulary, as vLLM's, and decoding is greedy past
EOS, so every run computes the same number of tokens. The prefix cache is emptied before each
timed run: no run reuses the KV of another. ``--output-json`` writes the figures, the flags and
the engine's counters (prefix-cache hits, preemptions) of the timed runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from pagedllm.entrypoints import bench_serve
from pagedllm.entrypoints.bench_serve import percentile, require_counts, write_figures

PERCENTILES = (10, 25, 50, 75, 90, 99)
DESCRIPTION = (
    "vLLM's benchmarks. latency: one batch of random-token prompts, run after run (mean and "
    "percentile latency). throughput: many requests at once (requests/s, tokens/s). Both load "
    "the model here with the engine flags of `pagedllm generate`, decode greedily past EOS and "
    "start each timed run from an empty prefix cache. serve: requests streamed from a running "
    "OpenAI-compatible server (TTFT, TPOT and inter-token latency percentiles)."
)


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """count prompts of length token ids drawn from [0, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


class Runner:
    """An engine and the requests of a benchmark, run from an empty prefix cache each time."""

    def __init__(self, ns: argparse.Namespace, count: int) -> None:
        from pagedllm.entrypoints.cli import engine_args_from
        from pagedllm.entrypoints.llm import LLM
        from pagedllm.sampling_params import SamplingParams

        require_counts(ns, "input_len", "output_len", "n", "batch_size", "num_iters", "num_prompts")
        if getattr(ns, "num_iters_warmup", 0) < 0:
            raise ValueError("--num-iters-warmup must be at least 0")
        self.llm = LLM.from_engine_args(engine_args_from(ns))
        engine = self.llm.llm_engine
        vocab = engine.config.model.hf_config.vocab_size
        self.prompts = random_prompts(vocab, count, ns.input_len, ns.seed)
        self.params = SamplingParams(
            n=ns.n, temperature=0.0, max_tokens=ns.output_len, ignore_eos=True, detokenize=False
        )
        self.prefix_hits = 0
        self.preemptions = 0

    def run(self) -> tuple[float, int]:
        """Seconds for the requests, and the output tokens they produced."""
        engine = self.llm.llm_engine
        engine.block_manager.reset_prefix_cache()
        hits, preemptions = engine.block_manager.prefix_cache_hits, engine.scheduler.num_preemptions
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        self.prefix_hits += engine.block_manager.prefix_cache_hits - hits
        self.preemptions += engine.scheduler.num_preemptions - preemptions
        return seconds, sum(len(c.token_ids) for out in outputs for c in out.outputs)


def _progress(text: str) -> None:
    """A line of progress on a terminal's stderr, overwritten by the next ("" clears it)."""
    if sys.stderr.isatty():
        print(f"\r{text:<40}", end="" if text else "\r", file=sys.stderr, flush=True)


def _latency(ns: argparse.Namespace) -> int:
    runner = Runner(ns, ns.batch_size)
    for i in range(ns.num_iters_warmup):
        _progress(f"warm-up {i + 1}/{ns.num_iters_warmup}")
        runner.run()
    runner.prefix_hits = runner.preemptions = 0
    latencies, tokens = [], []
    for i in range(ns.num_iters):
        _progress(f"run {i + 1}/{ns.num_iters}")
        seconds, produced = runner.run()
        latencies.append(seconds)
        tokens.append(produced)
    _progress("")
    mean = sum(latencies) / len(latencies)
    percentiles = {str(p): percentile(latencies, p) for p in PERCENTILES}
    print(f"Avg latency: {mean:.4f} seconds")
    for pct, value in percentiles.items():
        print(f"{pct}% percentile latency: {value:.4f} seconds")
    print(f"Output tokens per batch: {tokens[0]}; {tokens[0] / mean:.1f} output tokens/s")
    write_figures(
        ns.output_json,
        ns,
        {
            "avg_latency": mean,
            "latencies": latencies,
            "percentiles": percentiles,
            "output_tokens_per_iter": tokens,
            "prefix_cache_hits": runner.prefix_hits,
            "preemptions": runner.preemptions,
        },
    )
    return 0


def _throughput(ns: argparse.Namespace) -> int:
    runner = Runner(ns, ns.num_prompts)
    if ns.warmup:
        runner.llm.generate([runner.prompts[0][:8]], runner.params, use_tqdm=False)
    seconds, produced = runner.run()
    prompt_tokens = ns.num_prompts * ns.input_len
    print(
        f"Throughput: {ns.num_prompts / seconds:.2f} requests/s, "
        f"{(prompt_tokens + produced) / seconds:.2f} total tokens/s, "
        f"{produced / seconds:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens: {prompt_tokens}\nTotal num output tokens: {produced}")
    write_figures(
        ns.output_json,
        ns,
        {
            "elapsed_time": seconds,
            "num_requests": ns.num_prompts,
            "total_num_tokens": prompt_tokens + produced,
            "num_output_tokens": produced,
            "requests_per_second": ns.num_prompts / seconds,
            "tokens_per_second": (prompt_tokens + produced) / seconds,
            "output_tokens_per_second": produced / seconds,
            "prefix_cache_hits": runner.prefix_hits,
            "preemptions": runner.preemptions,
        },
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    from pagedllm.entrypoints.cli import SUBCOMMANDS

    p = subparsers.add_parser(name, help=SUBCOMMANDS[name][1], description=DESCRIPTION)
    kinds = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    lat, flags = _benchmark(
        kinds, "latency", "one batch's latency, run after run",
        "The latency of one batch of requests, run after run (vllm bench latency).", 32,
    )  # fmt: skip
    flags.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    flags.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs first")
    flags.add_argument("--num-iters", type=int, default=30, help="timed runs")
    lat.set_defaults(func=_latency)
    thr, flags = _benchmark(
        kinds, "throughput", "requests/s and tokens/s of many requests at once",
        "Throughput of many requests given at once (vllm bench throughput).", 128,
    )  # fmt: skip
    flags.add_argument("--num-prompts", type=int, default=64, help="requests")
    flags.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one short request first (loads the kernels)",
    )
    thr.set_defaults(func=_throughput)
    from pagedllm.entrypoints.cli import DefaultsHelpFormatter

    srv = kinds.add_parser(
        "serve",
        help="latency percentiles of requests streamed from a running server",
        description=bench_serve.DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    bench_serve.add_arguments(srv)
    srv.set_defaults(func=bench_serve.run)
    return p


def _benchmark(
    kinds: argparse._SubParsersAction, name: str, help_text: str, description: str, input_len: int
) -> tuple[argparse.ArgumentParser, Any]:
    """A benchmark's parser with the flags both take (lengths, samples, JSON, engine flags),
    and its group of benchmark flags for the rest."""
    from pagedllm.entrypoints.cli import DefaultsHelpFormatter, add_engine_args

    p = kinds.add_parser(
        name, help=help_text, description=description, formatter_class=DefaultsHelpFormatter
    )
    group = p.add_argument_group("benchmark")
    group.add_argument("--input-len", type=int, default=input_len, help="prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="tokens generated")
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--output-json", default=None, help="write the figures here as JSON")
    add_engine_args(p, model_positional=True)
    return p, group

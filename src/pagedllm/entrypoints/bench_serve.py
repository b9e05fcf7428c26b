"""``pagedllm bench serve``: requests streamed from a running OpenAI-compatible server, as
``vllm bench serve`` sends them, and their TTFT, TPOT, ITL and end-to-end percentiles.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), each a
prompt of ``--input-len`` token ids drawn from the server's own tokenization of a text
(``/tokenize``), streamed from ``/v1/completions`` for exactly ``--output-len`` tokens (greedy,
``ignore_eos``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# benchmarks/serving.py runs this client at several rates, and against llama.cpp's server.

DESCRIPTION = (
    "Requests streamed from a running OpenAI-compatible server, as `vllm bench serve` sends "
    "them: prompts of random tokens from the server's /tokenize, Poisson arrivals at "
    "--request-rate (inf: all at once), exactly --output-len tokens each (greedy, ignore_eos). "
    "Prints throughput and the TTFT, TPOT, inter-token and end-to-end latency percentiles."
)

CORPUS = (
    "The scheduler admits waiting requests while the token budget lasts. Every running "
    "sequence decodes one token per step; long prompts are split into chunks. Blocks of the "
    "key-value cache are shared between requests with a common prefix, and freed blocks stay "
    "cached until memory is needed. A list is a mutable sequence; dictionaries map keys to "
    "values; tuples are immutable. 0123456789 (){}[] <>=+-*/ .,;:!? "
) * 4


def percentile(values: list[float], pct: float) -> float:
    """The pct-th percentile, linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0  # seconds from sending to the first text chunk
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # gaps between text chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Target:
    """Where the requests go: the base URL (no /v1), the model name, the API key."""

    url: str
    model: str | None = None
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_prompts(target: Target, num: int, input_len: int, seed: int) -> list[list[int]]:
    """num prompts of input_len token ids drawn from the server's tokenization of CORPUS."""
    body = {"prompt": CORPUS, **({"model": target.model} if target.model else {})}
    r = httpx.post(target.url + "/tokenize", json=body, headers=target.headers, timeout=30)
    if r.status_code != 200:
        raise ValueError(f"{target.url}/tokenize answered HTTP {r.status_code}: {r.text[:200]}")
    pool = r.json()["tokens"]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num)]


def served_model(target: Target) -> str | None:
    """The first model /v1/models lists (None where it lists none)."""
    r = httpx.get(target.url + "/v1/models", headers=target.headers, timeout=30)
    if r.status_code != 200:
        raise ValueError(f"{target.url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    return data[0]["id"] if data else None


async def send(
    client: httpx.AsyncClient, target: Target, prompt: list[int], output_len: int
) -> Result:
    """One streamed completion; its timings, and ok only where it gave output_len tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"model": target.model} if target.model else {}),
    }
    result = Result()
    chunks = 0  # one per token: the count when a server sends no usage (llama.cpp)
    start = last = time.perf_counter()
    url = target.url + "/v1/completions"
    try:
        async with client.stream("POST", url, json=body, headers=target.headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                if "text" in choice and (choice["text"] or choice.get("finish_reason") is None):
                    chunks += 1  # a token (text may wait for the rest of a UTF-8 character)
                if chunk.get("choices") and choice["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = result.output_tokens == output_len
        if not result.ok:
            result.error = f"{result.output_tokens} tokens instead of {output_len}"
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_rate(
    target: Target, prompts: list[list[int]], output_len: int, rate: float, seed: int
) -> tuple[list[Result], float]:
    """Send every prompt with Poisson arrivals at rate req/s; (results, wall seconds)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(client, target, prompt, output_len)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def run_sequential(target: Target, prompts: list[list[int]], output_len: int) -> list[Result]:
    async with httpx.AsyncClient(timeout=600) as client:
        return [await send(client, target, p, output_len) for p in prompts]


def _stat(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def summarize(rate: float, results: list[Result], seconds: float) -> dict:
    """Throughput and the latency percentiles (ms) of the completed requests."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    row = {
        "rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "seconds": seconds,
        "req_per_s": len(ok) / seconds,
        "out_tok_per_s": output_tokens / seconds,
        "output_tokens": output_tokens,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2e": [r.e2e for r in ok],
    }
    for name, values in series.items():
        row[f"{name}_mean_ms"] = 1000 * sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = 1000 * _stat(values, q)
    return row


def report(row: dict, input_tokens: int) -> str:
    """vLLM's result block."""
    lines = [
        " Serving Benchmark Result ".center(50, "="),
        f"{'Successful requests:':<40}{row['completed']}",
        f"{'Failed requests:':<40}{row['failed']}",
        f"{'Request rate (req/s):':<40}{row['rate']:g}",
        f"{'Benchmark duration (s):':<40}{row['seconds']:.2f}",
        f"{'Total input tokens:':<40}{input_tokens}",
        f"{'Total generated tokens:':<40}{row['output_tokens']}",
        f"{'Request throughput (req/s):':<40}{row['req_per_s']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{row['out_tok_per_s']:.2f}",
        f"{'Total token throughput (tok/s):':<40}"
        f"{(input_tokens + row['output_tokens']) / row['seconds']:.2f}",
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2e", "End-to-end Latency"),
    ):
        name = key.upper()
        lines += [
            f" {title} ".center(50, "-"),
            f"{f'Mean {name} (ms):':<40}{row[f'{key}_mean_ms']:.2f}",
            f"{f'Median {name} (ms):':<40}{row[f'{key}_p50_ms']:.2f}",
            f"{f'P90 {name} (ms):':<40}{row[f'{key}_p90_ms']:.2f}",
            f"{f'P99 {name} (ms):':<40}{row[f'{key}_p99_ms']:.2f}",
        ]
    lines.append("=" * 50)
    for error in row["errors"]:
        lines.append(f"failed: {error}")
    return "\n".join(lines)


def require_counts(ns: argparse.Namespace, *names: str) -> None:
    """ValueError naming the first of these flags given below 1 (absent ones pass)."""
    for name in names:
        if getattr(ns, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def write_figures(path: str | None, ns: argparse.Namespace, figures: dict) -> None:
    """figures and the parsed flags as strict JSON at path (nothing without one); the API key
    and the raw command line (which may hold it) stay out."""
    if not path:
        return
    kinds = (str, int, float, bool, list)
    flags = {k: v for k, v in vars(ns).items() if isinstance(v, kinds)}
    for secret in ("api_key", "raw_argv"):
        flags.pop(secret, None)
    Path(path).write_text(json.dumps(_plain({**figures, "args": flags}), indent=2) + "\n")
    print(f"figures written to {path}")


def run(ns: argparse.Namespace) -> int:
    require_counts(ns, "num_prompts", "input_len", "output_len")
    if not ns.request_rate > 0:
        raise ValueError("--request-rate must be above 0 (inf: every request at once)")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    url = ns.base_url.rstrip("/").removesuffix("/v1")  # an OpenAI client's base URL works too
    target = Target(url, ns.model, ns.api_key)
    try:
        target.model = target.model or served_model(target)
        prompts = make_prompts(target, ns.num_prompts, ns.input_len, ns.seed)
    except httpx.HTTPError as e:
        raise ValueError(f"no server answers at {target.url}: {e!r}") from e
    results, seconds = asyncio.run(
        run_rate(target, prompts, ns.output_len, ns.request_rate, ns.seed)
    )
    row = summarize(ns.request_rate, results, seconds)
    print(report(row, ns.num_prompts * ns.input_len))
    record = {**row, "model": target.model, "input_tokens": ns.num_prompts * ns.input_len}
    write_figures(ns.output_json, ns, record)
    return 0 if row["failed"] == 0 else 1


def _plain(value: object) -> object:
    """value with strict JSON's numbers: an infinite rate as "inf", a missing figure (NaN,
    no request completed) as null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("benchmark")
    group.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server, without /v1"
    )
    group.add_argument("--model", default=None, help="model name (default: the first served)")
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: $OPENAI_API_KEY)",
    )
    group.add_argument("--num-prompts", type=int, default=64, help="requests")
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="tokens generated")
    group.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson arrivals (inf: every request at once)",
    )
    group.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    group.add_argument("--output-json", default=None, help="write the figures here as JSON")

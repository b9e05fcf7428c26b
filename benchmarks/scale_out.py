"""Scale-out: one replica with T threads vs two replicas with T/2 threads each behind
vllm-router, and kv_aware vs round_robin routing on a shared-prefix workload.

    python benchmarks/scale_out.py [--model models/pagedllm-demo] [--threads 2]
        [--groups 8] [--per-group 8] [--concurrency 8] [--max-tokens 16]

The workload: ``groups`` long prefixes (a system prompt or document each), ``per-group``
requests per prefix with their own question, sent by ``concurrency`` clients in a shuffled
order (seeded). Each streaming completion's TTFT is taken at its first token. Prints one row
per setup: requests/s, output tokens/s, p50 / p99 TTFT, prefix-hit rate (prefix_cache_hits
over prefix_cache_queries from the replicas' /metrics). Needs vllm-router (pip) and an idle
machine: the replicas and the router share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedllm.entrypoints.data_parallel import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
WORDS = "river stone lamp orchard violin harbor cedar meadow copper lantern glacier".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str
    events: str


def start_replica(model: str, threads: int) -> Replica:
    port, ev = free_port(), free_port()
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ev}"})
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, f"--port={port}"]
    cmd += ["--served-model-name=m", "--disable-log-stats", f"--kv-events-config={events}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180)
    return Replica(proc, url, f"tcp://127.0.0.1:{ev}")


def start_router(policy: str, replicas: list[Replica], model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [shutil.which("vllm-router") or "vllm-router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *[r.url for r in replicas], "--policy", policy]
    cmd += ["--prometheus-port", str(free_port())]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.events}"]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", "m"]
    env = {**os.environ, "VLLM_ROUTER_TOKENIZER": model}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 60)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def workload(groups: int, per_group: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = " ".join(rng.choice(WORDS) for _ in range(120)) + f" (document {g})."
        prompts += [f"{prefix} Question {q}: what comes next?" for q in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def run(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Send every prompt (streaming) from concurrency clients; TTFTs and totals."""
    todo = list(prompts)
    lock = threading.Lock()
    ttfts: list[float] = []
    tokens = [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
                body |= {"temperature": 0, "ignore_eos": True}
                start, first, n = time.perf_counter(), None, 0
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            first = first or time.perf_counter()
                            n += 1
                with lock:
                    ttfts.append((first or time.perf_counter()) - start)
                    tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    ttfts.sort()
    return {
        "req/s": len(prompts) / seconds,
        "tok/s": tokens[0] / seconds,
        "p50 TTFT ms": 1000 * ttfts[len(ttfts) // 2],
        "p99 TTFT ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def hit_rate(replicas: list[Replica]) -> float:
    hits = queries = 0.0
    for r in replicas:
        text = httpx.get(r.url + "/metrics").text
        hits += float(re.search(r"^vllm:prefix_cache_hits_total\{.*\} (\S+)$", text, re.M)[1])
        queries += float(re.search(r"^vllm:prefix_cache_queries_total\{.*\} (\S+)$", text, re.M)[1])
    return hits / queries if queries else 0.0


def measure(setup: str, args: argparse.Namespace, prompts: list[str]) -> dict:
    """Fresh replicas for each setup, so that no prefix is cached from the one before."""
    if setup == "1 replica":
        replicas = [start_replica(args.model, args.threads)]
        router, url = None, replicas[0].url
    else:
        half = max(1, args.threads // 2)
        replicas = [start_replica(args.model, half), start_replica(args.model, half)]
        router, url = start_router(setup.split()[-1], replicas, args.model)
    try:
        row = {"setup": setup, **run(url, prompts, args.concurrency, args.max_tokens)}
        row["prefix hit rate"] = hit_rate(replicas)
        return row
    finally:
        if router is not None:
            stop(router)
        for r in replicas:
            stop(r.proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "pagedllm-demo"))
    p.add_argument("--threads", type=int, default=2, help="threads of the single replica")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    load = os.getloadavg()
    prompts = workload(args.groups, args.per_group, args.seed)
    setups = ["1 replica", "2 replicas round_robin", "2 replicas kv_aware"]
    rows = [measure(s, args, prompts) for s in setups]
    head = ["setup", "req/s", "tok/s", "p50 TTFT ms", "p99 TTFT ms", "prefix hit rate"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [row["setup"]] + [f"{row[k]:.2f}" for k in head[1:]]
        print("| " + " | ".join(cells) + " |")
    print(f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Start-up time: `pagedllm generate` and `pagedllm serve` against `python -c "import torch"`.

Each round runs, one after the other: ``python -c "import torch"``, the generate command
(``pagedllm generate "A dictionary is" --max-tokens 32`` on the demo model) and a serve
start that polls ``GET /health`` until it answers 200. Rounds interleave the commands so
that machine load hits them alike; the report gives each command's median and the
differences to ``import torch``. Optional ``--src`` folders run other source trees the same
way (PYTHONPATH first), e.g. a checkout of an older commit for a before/after comparison.

examples:
  python benchmarks/startup.py --rounds 5
  python benchmarks/startup.py --rounds 3 --src /tmp/old/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "A dictionary is"
# One process, timed phase by phase (the steps `pagedllm generate` takes).
PHASES = """
import json, sys, time
t = [time.perf_counter()]
import torch
t.append(time.perf_counter())
from pagedllm.entrypoints.cli import main  # the CLI module graph
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
t.append(time.perf_counter())
from pagedllm.config import EngineArgs
config = EngineArgs().create_engine_config()
t.append(time.perf_counter())
from pagedllm.engine.tokenizer import load_tokenizer
load_tokenizer(config.model.tokenizer)
t.append(time.perf_counter())
llm = LLM()
t.append(time.perf_counter())
llm.generate([sys.argv[1]], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
t.append(time.perf_counter())
names = ["import torch", "import pagedllm (CLI, engine)", "read config", "load tokenizer",
         "LLM() ready (config, tokenizer, weights, KV cache, kernel)", "generate 32 tokens"]
print(json.dumps({n: b - a for n, a, b in zip(names, t, t[1:])}))
"""


def _env(src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve())
    return env


def time_command(args: list[str], src: str | None) -> float:
    """Wall seconds of one run of a command (which must succeed)."""
    start = time.perf_counter()
    subprocess.run(args, env=_env(src), check=True, capture_output=True)
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_serve(src: str | None, timeout: float = 300.0) -> float:
    """Seconds from starting `pagedllm serve` until GET /health answers 200."""
    port = _free_port()
    args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        args, env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError("serve did not become healthy")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_phases(src: str | None) -> dict[str, float]:
    """Seconds of each start-up phase of one process (see PHASES)."""
    out = subprocess.run(
        [sys.executable, "-c", PHASES, PROMPT],
        env=_env(src),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--src", action="append", help="source tree to put first on PYTHONPATH")
    p.add_argument("--no-serve", action="store_true", help="skip the serve measurement")
    p.add_argument("--phases", action="store_true", help="also time each start-up phase")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    sources = args.src or [None]
    generate = [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", PROMPT]
    generate += ["--max-tokens", "32"]
    times: dict[str, list[float]] = {"import torch": []}
    for _ in range(args.rounds):
        times["import torch"].append(time_command([sys.executable, "-c", "import torch"], None))
        for src in sources:
            times.setdefault(f"generate [{src}]", []).append(time_command(generate, src))
            if not args.no_serve:
                times.setdefault(f"serve /health [{src}]", []).append(time_serve(src))
            if args.phases:
                for phase, seconds in time_phases(src).items():
                    times.setdefault(f"phase {phase} [{src}]", []).append(seconds)
    base = statistics.median(times["import torch"])
    report = {
        name: {"median_s": statistics.median(v), "runs_s": v, "minus_import_torch_s": None}
        for name, v in times.items()
    }
    for name, row in report.items():
        if not name.startswith(("import torch", "phase")):
            row["minus_import_torch_s"] = row["median_s"] - base
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

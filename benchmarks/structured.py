"""Per-step cost of structured outputs: a fully constrained batch vs an unconstrained one.

The 125M Llama benchmark model (random weights) with a 32000-token byte-level BPE tokenizer
trained by common.build_stdlib_tokenizer (the model ships none). Each batch decodes with a
JSON schema (an array of at least 8 records: strings, integers, enums, nested objects), so
no sequence can finish inside the measured window; the per-step time counts only pure decode
steps with the whole batch running. Three engines in one process step in turn, so that the
load of a shared machine drifts over all three alike: free, constrained (the CPU default:
masks filled on the engine thread), and constrained with the masks filled in a thread during
the forward (the CUDA default, forced here). "mask fill" and "engine-thread" (all the
structured-output work on the engine thread: filling or waiting, masking the logits,
advancing the matchers) are per constrained step of the default engine.

    nice -n 10 python benchmarks/structured.py [--batch-sizes 1 8 32] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    build_bench_model,
    build_stdlib_tokenizer,
    default_model_dir,
    machine,
)

from pagedllm import SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 8}},
    "required": ["records"],
}


VARIANTS = ("free", "constrained", "overlap thread")


def add_batch(engine: LLMEngine, batch: int, max_tokens: int, constrained: bool) -> None:
    rng = random.Random(batch)  # the same prompts for every variant
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        prompt = [rng.randrange(3, 32000) for _ in range(32)]
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
        )
        engine.add_request(f"{batch}-{i}", prompt, params)


def timed_step(engine: LLMEngine, batch: int) -> tuple[float, float] | None:
    """(wall, process CPU) seconds of one step; None unless it was a pure decode step of the
    whole batch."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.step()
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    pure_decode = len(outs) == batch and all(len(o.outputs[0].token_ids) > 1 for o in outs)
    return elapsed if pure_decode else None


def run_batch(engines: dict[str, LLMEngine], batch: int, steps: int) -> dict[str, list]:
    """The variants' decode steps, alternated step by step so that load drifts hit each."""
    for name, engine in engines.items():
        add_batch(engine, batch, steps + 8, constrained=name != "free")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    while min(len(t) for t in times.values()) < steps:
        for name, engine in engines.items():
            sample = timed_step(engine, batch)
            if sample is not None:
                times[name].append(sample)
    for engine in engines.values():
        engine.abort_request(list(engine.requests))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model = build_bench_model(default_model_dir())
    tokenizer = build_stdlib_tokenizer(default_model_dir().parent / "tokenizer-32k")
    engine_args = EngineArgs(
        model=str(model), tokenizer=str(tokenizer), kv_cache_memory_bytes=1 << 30
    )
    engines = {name: LLMEngine.from_engine_args(engine_args) for name in VARIANTS}
    engines["overlap thread"].structured._overlap = True  # the CUDA default, forced
    print(machine())
    print(f"schema: {json.dumps(SCHEMA)[:80]}...")
    print(
        "| batch | free ms/step (wall / CPU) | constrained (wall / CPU) | overhead (wall / CPU) "
        "| with overlap thread (wall / CPU) | mask fill ms/step | engine-thread ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    run_batch(engines, 2, 2)  # warm-up: kernels, grammar compile cache
    for batch in args.batch_sizes:
        stats = engines["constrained"].structured.stats
        before = (stats.num_steps, stats.fill_seconds, stats.wait_seconds, stats.engine_seconds)
        times = run_batch(engines, batch, args.steps)
        n = stats.num_steps - before[0]  # every constrained step, prefill ones too
        fill, wait, on_engine = (
            (now - was) / n * 1e3
            for now, was in zip(
                (stats.fill_seconds, stats.wait_seconds, stats.engine_seconds), before[1:]
            )
        )
        med = {
            k: [statistics.median(t[i] for t in v) * 1e3 for i in (0, 1)] for k, v in times.items()
        }
        free, over, thread = med["free"], med["constrained"], med["overlap thread"]
        print(
            f"| {batch} | {free[0]:.1f} / {free[1]:.1f} | {over[0]:.1f} / {over[1]:.1f} | "
            f"{(over[0] / free[0] - 1) * 100:+.1f}% / {(over[1] / free[1] - 1) * 100:+.1f}% | "
            f"{thread[0]:.1f} / {thread[1]:.1f} | {fill:.2f} | {on_engine:.2f} |",
            flush=True,
        )
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()

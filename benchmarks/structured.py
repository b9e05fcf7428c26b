"""Per-step cost of structured outputs: a fully constrained batch vs an unconstrained one.

The 125M Llama benchmark model (random weights) with a 32000-token byte-level BPE tokenizer
trained by common.build_bench_tokenizer (the model ships none). Each batch decodes with a
JSON schema (an array of at least 8 records: strings, integers, enums, nested objects), so
no sequence can finish inside the measured window; the per-step time counts only pure decode
steps with the whole batch running. "constrained, no overlap" fills the masks on the engine
thread before the forward, to show what the background fill hides. On a shared, loaded
machine the step times drift by more than the overhead; "engine-thread ms/step" (the
structured-output work on the engine thread: starting the fill, waiting for it, masking the
logits, advancing the matchers, per measured step) and the fill thread's time are measured
directly, and the process CPU time per step (all threads) drifts far less than wall time.

    nice -n 10 python benchmarks/structured.py [--batch-sizes 1 8 32] [--steps 8] [--rounds 3]
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
    build_bench_tokenizer,
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


def decode_step_times(
    engine: LLMEngine, batch: int, steps: int, constrained: bool
) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each pure decode step with the whole batch running."""
    rng = random.Random(batch)
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        prompt = [rng.randrange(3, 32000) for _ in range(32)]
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True, structured_outputs=so
        )
        engine.add_request(f"{constrained}-{batch}-{i}", prompt, params)
    times: list[tuple[float, float]] = []
    while engine.has_unfinished_requests():
        start, cpu = time.perf_counter(), time.process_time()
        running = len(engine.scheduler.running)
        outs = engine.step()
        elapsed = (time.perf_counter() - start, time.process_time() - cpu)
        pure_decode = all(len(o.outputs[0].token_ids) > 1 for o in outs)
        if running == batch and len(outs) == batch and pure_decode:
            times.append(elapsed)
        if len(times) >= steps:
            engine.abort_request(list(engine.requests))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = build_bench_model(default_model_dir())
    tokenizer = build_bench_tokenizer(default_model_dir().parent / "tokenizer-32k")
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model), tokenizer=str(tokenizer), kv_cache_memory_bytes=1 << 30)
    )
    manager = engine.structured
    print(machine())
    print(f"schema: {json.dumps(SCHEMA)[:80]}...")
    print(
        "| batch | free ms/step (wall / CPU) | constrained ms/step (wall / CPU) | overhead "
        "(wall / CPU) | no-overlap ms/step (wall / CPU) | mask fill ms/step | sampler wait "
        "ms/step | engine-thread ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    decode_step_times(engine, 2, 4, True)  # warm-up: kernels, grammar compile cache
    decode_step_times(engine, 2, 4, False)
    for batch in args.batch_sizes:
        times: dict[str, list[tuple[float, float]]] = {"free": [], "overlap": [], "serial": []}
        fill = wait = on_engine = 0.0
        for _ in range(args.rounds):  # interleaved, so that load drifts hit every mode
            times["free"] += decode_step_times(engine, batch, args.steps, False)
            manager._overlap = False
            times["serial"] += decode_step_times(engine, batch, args.steps, True)
            manager._overlap = True
            stats = manager.stats
            before = (stats.fill_seconds, stats.wait_seconds, stats.engine_seconds)
            run = decode_step_times(engine, batch, args.steps, True)
            times["overlap"] += run
            # over the whole run (its prefill steps too), per measured step
            fill += (stats.fill_seconds - before[0]) / len(run) / args.rounds
            wait += (stats.wait_seconds - before[1]) / len(run) / args.rounds
            on_engine += (stats.engine_seconds - before[2]) / len(run) / args.rounds
        med = {
            k: [statistics.median(t[i] for t in v) * 1e3 for i in (0, 1)] for k, v in times.items()
        }
        free, over, serial = med["free"], med["overlap"], med["serial"]
        print(
            f"| {batch} | {free[0]:.1f} / {free[1]:.1f} | {over[0]:.1f} / {over[1]:.1f} | "
            f"{(over[0] / free[0] - 1) * 100:+.1f}% / {(over[1] / free[1] - 1) * 100:+.1f}% | "
            f"{serial[0]:.1f} / {serial[1]:.1f} | {fill * 1e3:.2f} | {wait * 1e3:.2f} | "
            f"{on_engine * 1e3:.2f} |",
            flush=True,
        )
    engine.shutdown()


if __name__ == "__main__":
    main()

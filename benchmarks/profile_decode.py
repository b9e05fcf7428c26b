"""Where a decode step's time goes: wall time per step split into engine phases, and
torch.profiler's operator table, at a given batch size.

    python benchmarks/profile_decode.py --batch 1 --dtype float32
    python benchmarks/profile_decode.py --batch 1 --quantization int8 --steps 32
    python benchmarks/profile_decode.py --batch 32 --trace /tmp/decode.json   # chrome trace
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402


def decode_engine(model: Path, batch: int, prompt_len: int, engine_kwargs: dict):  # noqa: ANN201
    """An engine with `batch` requests prefilled and decoding (prompts are token ids)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), skip_tokenizer_init=True, **engine_kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True, detokenize=False)
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 30000 + 3 for j in range(prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in _running(engine)):
        engine.step()
    return llm


def _running(engine) -> list:  # noqa: ANN001
    return list(engine.scheduler.running) + list(engine.scheduler.waiting)


def timed_steps(engine, steps: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quant-activation", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--rows", type=int, default=25, help="operator table rows")
    ap.add_argument("--trace", type=Path, default=None, help="write a chrome trace here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or build_bench_model(default_model_dir())
    kwargs = dict(
        dtype=args.dtype,
        quantization=args.quantization,
        quant_activation=bool(args.quant_activation),
        enforce_eager=args.enforce_eager,
        max_num_seqs=max(args.batch, 1),
    )
    print(f"machine: {machine()}\nengine: {kwargs}, batch {args.batch}")
    llm = decode_engine(model, args.batch, args.prompt_len, kwargs)
    engine = llm.llm_engine
    timed_steps(engine, 8)  # warm-up
    cpu0 = time.process_time()
    step = timed_steps(engine, args.steps)
    cpu = (time.process_time() - cpu0) / args.steps
    print(
        f"decode step {step * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms CPU "
        f"-> {args.batch / step:.1f} tok/s"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("engine.step"):
                engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()

"""Where one engine step's time goes at batch, beyond the GEMMs.

Puts ``batch`` sequences into decode on the 125M benchmark model (float32, all threads) and
times steps of two kinds: decode (every sequence one token) and mixed (the same decodes plus
one new 256-token prompt each step). Each step is split into scheduler, input building,
model forward (GEMMs, attention, the rest), logits + sampling, and output processing
(scheduler update, detokenization, stop checks, output objects). The GEMM rate of this
machine at the same shapes and row counts is measured in the same run, so the share of the
GEMM peak a step reaches is printed next to it.

    python benchmarks/step_profile.py --batches 32 256
    python benchmarks/step_profile.py --batches 32 --torch-profile   # op table as well
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import BENCH_125M, build_bench_model, default_model_dir, machine  # noqa: E402

PROMPT_LEN = 128
MIXED_PROMPT = 256


# ---- the machine's GEMM rate ----------------------------------------------------------------
def linear_shapes(c: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections (qkv, o, gate_up, down)."""
    h, i = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    return [(h, qkv), (h, h), (h, 2 * i), (i, h)]


def gemm_seconds(rows: int, k: int, n: int, repeat: int = 20) -> float:
    """Median seconds of F.linear([rows, k] x [n, k]^T) in float32."""
    x, w = torch.randn(rows, k), torch.randn(n, k)
    for _ in range(3):
        F.linear(x, w)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_model(rows: int, sampled: int) -> tuple[float, float]:
    """(FLOPs, seconds at the measured rate) of one step's linears: all layers at `rows` rows,
    the LM head at `sampled` rows."""
    c = BENCH_125M
    flops = seconds = 0.0
    for k, n in linear_shapes(c):
        t = gemm_seconds(rows, k, n)
        flops += c["num_hidden_layers"] * 2 * rows * k * n
        seconds += c["num_hidden_layers"] * t
    flops += 2 * sampled * c["hidden_size"] * c["vocab_size"]
    seconds += gemm_seconds(sampled, c["hidden_size"], c["vocab_size"], repeat=5)
    return flops, seconds


# ---- timing the engine's pieces ---------------------------------------------------------------
class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn: Callable = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start

        setattr(obj, name, timed)


class TimedSampler:
    """The runner's sampler, its calls timed (a callable object: wrap() would hide .release)."""

    def __init__(self, sampler: Any, timers: Timers) -> None:
        self.sampler, self.timers = sampler, timers

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.sampler(*args)
        finally:
            self.timers.total["sampler"] += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def instrument(engine: Any) -> Timers:
    timers = Timers()
    runner = engine.executor.local_runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "prepare_input", "prepare_input")
    timers.wrap(runner, "forward", "forward")
    timers.wrap(runner, "compute_output", "logits+sample")
    runner.sampler = TimedSampler(runner.sampler, timers)
    timers.wrap(engine.scheduler, "update", "scheduler.update")
    timers.wrap(engine, "_process", "process(detok,outputs)")
    for layer in runner.model.attention_layers():
        timers.wrap(layer, "forward", "attention")
    for module in runner.model.modules():
        if type(module).__name__.endswith("Linear"):
            timers.wrap(module, "forward", "linears")
    return timers


def make_engine(model: Path, batch: int) -> Any:
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=str(model),
        dtype="float32",
        max_num_seqs=batch + 1,
        max_num_batched_tokens=max(2048, batch + MIXED_PROMPT),
        kv_cache_memory_bytes=(batch + 8) * 512 * 12 * 2 * 4 * 64 * 4,
    )
    return LLMEngine.from_engine_args(args)


def fill(engine: Any, batch: int, steps: int) -> None:
    """batch requests that will decode for longer than the measured steps, all prefilled."""
    from pagedllm.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 64, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, 32000, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()


def timed_steps(engine: Any, steps: int, mixed: bool, timers: Timers) -> tuple[float, int]:
    """Mean seconds per step; mixed steps each add a fresh prompt that finishes after it."""
    from pagedllm.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(1)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timers.total.clear()
    start = time.perf_counter()
    for i in range(steps):
        if mixed:
            ids = torch.randint(3, 32000, (MIXED_PROMPT,), generator=gen).tolist()
            engine.add_request(f"m{i}-{time.time_ns()}", ids, one)
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    rows = len(engine.scheduler.running)
    return seconds, rows


def report(label: str, step: float, timers: Timers, steps: int, gemm: tuple[float, float]) -> None:
    flops, gemm_s = gemm
    t = {k: v / steps for k, v in timers.total.items()}
    python = (
        t.get("schedule", 0)
        + t.get("prepare_input", 0)
        + t.get("scheduler.update", 0)
        + t.get("process(detok,outputs)", 0)
        + t.get("sampler", 0)
    )
    lines = [f"{label}: step {1000 * step:.1f} ms"]
    for key in (
        "schedule",
        "prepare_input",
        "forward",
        "linears",
        "attention",
        "logits+sample",
        "sampler",
        "scheduler.update",
        "process(detok,outputs)",
    ):
        lines.append(
            f"  {key:24s} {1000 * t.get(key, 0):8.2f} ms  {100 * t.get(key, 0) / step:5.1f}%"
        )
    other = t.get("forward", 0) - t.get("linears", 0) - t.get("attention", 0)
    share = 100 * other / step
    lines.append(f"  {'forward other (norm,act,rope)':24s} {1000 * other:8.2f} ms  {share:5.1f}%")
    lines.append(
        f"  python per-step (sched+input+sampler+update+process) {1000 * python:.2f} ms = "
        f"{100 * python / step:.1f}% of the step"
    )
    lines.append(
        f"  GEMMs: {flops / 1e9:.2f} GFLOP; at the measured GEMM rate {1000 * gemm_s:.1f} ms "
        f"({flops / gemm_s / 1e9:.1f} GFLOP/s); step reaches {100 * gemm_s / step:.1f}% of it "
        f"({flops / step / 1e9:.1f} GFLOP/s)"
    )
    print("\n".join(lines), flush=True)


def layer_elementwise_ms(rows: int, reps: int) -> dict[str, float]:
    """Min ms of one decoder layer's elementwise work (2 x residual + RMSNorm, rotary,
    SiLU-and-mul) at
    `rows` tokens, torch ops vs the fused kernels, interleaved; the minimum of many short
    repetitions is what survives a shared, loaded machine."""
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.custom_op import OpTarget, build_target
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    c = BENCH_125M
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    ops = {}
    for mode in ("0", "1"):  # each op picks its implementation when built
        with build_target(OpTarget("cpu", cpu_fused_ops=mode == "1")):
            ops[mode] = (
                RMSNorm(h, 1e-5, torch.float32),
                RotaryEmbedding(d, c["max_position_embeddings"], 10000.0, None, torch.float32),
                SiluAndMul(torch.float32),
            )
    qkv = torch.randn(rows, (heads + 2 * kv) * d)
    x, residual = torch.randn(rows, h), torch.randn(rows, h)
    gate_up = torch.randn(rows, 2 * c["intermediate_size"])
    positions = torch.randint(0, 1024, (rows,))
    best = {"0": math.inf, "1": math.inf}
    with torch.inference_mode():
        for _ in range(reps):
            for mode in best:
                norm, rope, act = ops[mode]
                xs, rs = x.clone(), residual.clone()
                start = time.perf_counter()
                xs, rs = norm(xs, rs)
                q, k, _ = qkv.split([heads * d, kv * d, kv * d], dim=-1)
                rope(positions, q.view(rows, heads, d), k.view(rows, kv, d))
                norm(xs, rs)
                act(gate_up)
                best[mode] = min(best[mode], time.perf_counter() - start)
    return {"torch": 1000 * best["0"], "fused": 1000 * best["1"]}


def torch_profile(engine: Any, steps: int, mixed: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_steps(engine, steps, mixed, Timers())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--ops", action="store_true", help="only the fused-op microbenchmark")
    ap.add_argument(
        "--compare-fused", action="store_true", help="each case with the fused ops off, then on"
    )
    args = ap.parse_args()
    if args.ops:
        for rows in args.batches + [b + MIXED_PROMPT for b in args.batches]:
            ms = layer_elementwise_ms(rows, args.steps)
            layers = BENCH_125M["num_hidden_layers"]
            saved = layers * (ms["torch"] - ms["fused"])
            print(
                f"layer elementwise at {rows} rows: torch {ms['torch']:.3f} ms, fused "
                f"{ms['fused']:.3f} ms ({ms['torch'] / ms['fused']:.1f}x; {saved:.2f} ms a "
                f"step saved over {layers} layers)",
                flush=True,
            )
        return
    model = args.model or build_bench_model(default_model_dir())
    print(f"machine: {machine()}", flush=True)
    modes = ["0", "1"] if args.compare_fused else [os.environ.get("PAGEDLLM_CPU_FUSED_OPS", "1")]
    for batch in args.batches:
        gemm_decode = gemm_model(batch, batch)
        gemm_mixed = gemm_model(batch + MIXED_PROMPT, batch + 1)
        for mode in modes:  # one engine per setting: it is read when the engine is built
            os.environ["PAGEDLLM_CPU_FUSED_OPS"] = mode
            engine = make_engine(model, batch)
            timers = instrument(engine)
            fill(engine, batch, args.steps)
            timed_steps(engine, 2, False, timers)  # warm-up
            for kind, gemm in (("decode", gemm_decode), ("mixed", gemm_mixed)):
                step, rows = timed_steps(engine, args.steps, kind == "mixed", timers)
                label = f"{kind} batch {rows}" + (
                    f" + {MIXED_PROMPT}-token prompt" * (kind == "mixed")
                )
                report(
                    f"{label}, fused ops {'on' if mode == '1' else 'off'}",
                    step,
                    timers,
                    args.steps,
                    gemm,
                )
            if args.torch_profile:
                torch_profile(engine, 5, False)
                torch_profile(engine, 5, True)
            engine.shutdown()


if __name__ == "__main__":
    main()

"""Tensor parallel: decode-step latency with communication overlap on vs off.

TP=2 on the CPU (gloo, one thread per rank) over the 125M benchmark model (random weights,
bf16 by default). Two measurements per batch size, each alternating its variants step by step
so that the drifting load of a shared machine falls on all of them alike:

1. engine decode steps (schedule, sharded forward, sample) with overlap on and off: latency,
   throughput, and the share of communication hidden = (t_off - t_on) / t_comm, where t_comm is
   the step's row-parallel all-reduces timed alone, on the same two ranks, with the same sizes;
2. the forward alone on both ranks: plain, split into two micro-batches with each all-reduce
   finished at once (the cost of splitting), and split with the all-reduces overlapped.

Overlap is forced on every step of two or more sequences (``overlap_min_tokens = 2``) so that
its effect is measured at every batch size; the engine's default applies it from 128 tokens up.
The forward-alone table also has prefill steps (2 x 32, 2 x 128 and 4 x 128 new tokens).
A batch of one sequence cannot be split, so there on and off run the same code: that row shows
the measurement noise.

    nice -n 5 python benchmarks/tp_overlap.py
    nice -n 5 python benchmarks/tp_overlap.py --batch-sizes 8 64 --rounds 8 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402

PROMPT_LEN = 32


def time_all_reduces(runner, batch: int, iters: int) -> float:  # noqa: ANN001 - every rank
    """Seconds per decode step spent in its 2 x layers all-reduces of [batch, hidden], alone."""
    layers = runner.model.model.layers
    comm = layers[0].mlp.down_proj.comm
    x = torch.zeros(batch, runner.model.config.hidden_size, dtype=runner.dtype)
    for _ in range(3):
        comm.all_reduce(x)  # warm-up, and both ranks start together
    start = time.perf_counter()
    for _ in range(iters):
        for _ in range(2 * len(layers)):
            comm.all_reduce(x)
    return (time.perf_counter() - start) / iters


class _FinishAtOnce:
    """The overlapped schedule with every all-reduce finished when it is issued."""

    def __init__(self, comm) -> None:  # noqa: ANN001
        self.comm = comm

    def all_reduce_async(self, x: torch.Tensor) -> _FinishAtOnce:
        self.x = self.comm.all_reduce(x)
        return self

    def wait(self) -> torch.Tensor:
        return self.x


def time_forward(runner, batch: int, new: int, rounds: int) -> dict[str, float]:  # noqa: ANN001
    """Median seconds of one forward of `batch` sequences three ways (every rank runs this).

    new == 1: a decode token after a cached PROMPT_LEN-token prompt; else a `new`-token prefill.
    """
    from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
    from pagedllm.core.sequence import Sequence
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.overlap import forward_overlapped, split_batch

    params = SamplingParams(temperature=0.0, max_tokens=1)
    length = PROMPT_LEN + 1 if new == 1 else new
    per_seq = -(-length // runner.block_size)
    scheduled = []
    for i in range(batch):
        seq = Sequence(i, str(i), 0, [3 + i] * length, params, None)
        seq.num_computed_tokens = length - new
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        scheduled.append(ScheduledSequence(seq, new))
    inp = runner.prepare_input(SchedulerOutput(scheduled, batch * new))
    comm = runner.model.model.layers[0].mlp.down_proj.comm
    batches = split_batch(inp.input_ids, inp.positions, inp.metadata)
    variants = {
        "plain": lambda: runner.forward(inp),
        "split": lambda: forward_overlapped(runner.model, batches, _FinishAtOnce(comm)),
        "overlap": lambda: forward_overlapped(runner.model, batches, comm),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, run in variants.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_steps(engine, batch: int, rounds: int) -> dict[bool, float]:  # noqa: ANN001
    """Median seconds of an engine step of `batch` decoding sequences, overlap on / off."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True, detokenize=False)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [3 + (i * 7 + j) % 31000 for j in range(PROMPT_LEN)], params)
    executor = engine.executor
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()  # prefill
    engine.step()  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for overlap in (True, False) if round_ % 2 else (False, True):
            executor.comm_overlap = overlap
            start = time.perf_counter()
            engine.step()
            times[overlap].append(time.perf_counter() - start)
    engine.abort_request(ids)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=16, help="steps of each variant")
    parser.add_argument("--comm-iters", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (the default) | float32")
    args = parser.parse_args()

    from pagedllm import LLMEngine
    from pagedllm.config import EngineArgs

    engine_args = EngineArgs(
        model=str(build_bench_model(args.model or default_model_dir())),
        dtype=args.dtype,
        tensor_parallel_size=2,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
    )
    torch.set_num_threads(2)  # the engine gives each of the 2 ranks half: 1 thread each
    engine = LLMEngine.from_engine_args(engine_args, skip_tokenizer_init=True)
    engine.executor.overlap_min_tokens = 2
    steps, forwards = [], []
    try:
        for batch in args.batch_sizes:
            run = engine.executor.collective_rpc
            comm = max(run(time_all_reduces, batch, args.comm_iters))
            steps.append((batch, decode_steps(engine, batch, args.rounds), comm))
            print(step_row(*steps[-1]), flush=True)
            if batch > 1:
                forwards.append((f"decode {batch}", run(time_forward, batch, 1, args.rounds)[0]))
                print(forward_row(*forwards[-1]), flush=True)
        for batch, new in ((2, 32), (2, 128), (4, 128)):
            run = engine.executor.collective_rpc
            forwards.append((f"prefill {batch} x {new}", run(time_forward, batch, new, 4)[0]))
            print(forward_row(*forwards[-1]), flush=True)
    finally:
        engine.shutdown()
    print_tables(args.dtype, steps, forwards)


def step_row(batch: int, t: dict[bool, float], comm: float) -> str:
    on, off = t[True], t[False]
    hidden = f"{(off - on) / comm:.0%}" if batch > 1 else "n/a"
    return (
        f"| {batch} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.3f} | {batch / off:.1f} | "
        f"{batch / on:.1f} | {comm * 1e3:.1f} | {comm / off:.0%} | {hidden} |"
    )


def forward_row(what: str, t: dict[str, float]) -> str:
    plain, split, overlap = t["plain"], t["split"], t["overlap"]
    return (
        f"| {what} | {plain * 1e3:.1f} | {split * 1e3:.1f} | {overlap * 1e3:.1f} | "
        f"{overlap / plain:.3f} | {(split - overlap) * 1e3:.1f} |"
    )


def print_tables(dtype: str, steps: list, forwards: list) -> None:  # noqa: ANN001
    print(f"\nmachine: {machine()}; TP=2, 1 thread per rank, {dtype}\n")
    print(
        "| batch | step off (ms) | step on (ms) | on / off | tok/s off | tok/s on "
        "| all-reduce alone (ms/step) | comm share of step off | hidden |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(step_row(*row) for row in steps))
    print(
        "\n| step | forward plain (ms) | split, reduce at once (ms) | split, overlapped (ms) "
        "| overlapped / plain | saved by overlapping (ms) |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(forward_row(*row) for row in forwards))


if __name__ == "__main__":
    main()

"""The sampler's two CPU paths on one batch of logits, taking turns: torch's (a softmax, the
filters' sort where top-k or top-p cut, exponential noise for every entry) and the fused
ops' (`cpu_fused.sample`: the inverse CDF, one uniform number a row).

    python benchmarks/sampling.py [--rows 48] [--vocab 49152] [--threads 2] [--reps 10]

The logits are standard normal times --scale (3: about as peaked as SmolLM2's at a
temperature of 0.7; 0.5 makes a flat row, where top-p keeps thousands of tokens). Each line
is one set of SamplingParams for every row; times are the best of --reps calls of the
Sampler, Python included, as a decode step calls it.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm import SamplingParams
from pagedllm.core.sequence import Sequence
from pagedllm.worker.sampler import Sampler

CASES = (
    {"temperature": 0.7},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 1.5, "top_p": 0.95},
    {"temperature": 0.0},
    # the demo model's generation_config defaults: penalties are torch ops on both paths
    {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1},
)


def best_ms(
    samplers: dict[str, Sampler], logits: torch.Tensor, seqs: list[Sequence], reps: int
) -> dict[str, float]:
    """Each sampler's best time in ms over reps calls, the samplers taking turns."""
    best = dict.fromkeys(samplers, float("inf"))
    for sampler in samplers.values():
        sampler(logits.clone(), seqs)  # warm-up: the fused ops' build, the first allocations
    for _ in range(reps):
        for name, sampler in samplers.items():
            x = logits.clone()
            start = time.perf_counter()
            sampler(x, seqs)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e3 for name, t in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * args.scale
    cpu = torch.device("cpu")
    paths = {"torch": Sampler(cpu), "fused": Sampler(cpu, cpu_fused_ops=True)}
    print(f"{args.rows} rows x {args.vocab} logits (randn x {args.scale}), {args.threads} threads")
    print(f"{'params':<52} {'torch ms':>9} {'fused ms':>9} {'speed-up':>9}")
    for case in CASES:
        params = SamplingParams(**case)
        history = torch.randint(args.vocab, (args.rows, 256)).tolist()  # the penalties' tokens
        seqs = [Sequence(i, f"r{i}", 0, history[i], params, None) for i in range(args.rows)]
        ms = best_ms(paths, logits, seqs, args.reps)
        label = ", ".join(f"{k}={v}" for k, v in case.items())
        print(f"{label:<52} {ms['torch']:>9.2f} {ms['fused']:>9.2f} "
              f"{ms['torch'] / ms['fused']:>8.1f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

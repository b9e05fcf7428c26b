"""Speculative decoding (n-gram prompt lookup): per-token latency with and without it.

The 125M Llama benchmark model (random weights) at batch 1 and batch 8, greedy, a fixed number
of output tokens per request (ignore_eos). Workloads:

- copy: each prompt is a random 32-token block repeated 4 times (128 tokens). A random-weight
  model does not learn to copy; its greedy output falls into short loops (often one token
  repeated), which the proposer predicts from the text itself. This stands for the case the
  method is for: output that repeats text already in the context.
- random: 128 random tokens per prompt, greedy. The random model's greedy output loops here
  too after a few tokens, so proposals are accepted there as well.
- random-sampled: the same prompts, temperature 1.0 (seeded). Over 32000 nearly equiprobable
  tokens no draft is ever accepted: this is the workload where speculation can only cost, and
  the adaptive back-off has to keep that cost small.

Per-token latency is the mean over requests of (last token time - first token time) / (tokens
- 1), i.e. decode only. Plain and speculative runs alternate (repeats), and the median is
reported, together with process CPU seconds per generated token (robust to a loaded machine).

    python benchmarks/speculative.py                       # all workloads, batch 1 and 8
    python benchmarks/speculative.py --workloads copy --batch-sizes 1 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402

VOCAB = 32000


def make_prompts(workload: str, batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    if workload == "copy":
        return [tok(32) * 4 for _ in range(batch)]
    if workload in ("random", "random-sampled"):
        return [tok(128) for _ in range(batch)]
    raise ValueError(f"unknown workload {workload!r}")


@dataclass
class Run:
    itl_ms: float  # mean decode latency per token, wall clock
    cpu_ms_per_token: float  # process CPU time per generated token (whole run)
    wall_s: float
    acceptance: float | None  # accepted / draft tokens
    mean_accepted_len: float | None  # 1 + accepted per verify step


class SpecCounter:
    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, _stats: object, it: object) -> None:
        spec = getattr(it, "spec_decoding", None)
        if spec is not None:
            self.drafts += spec.num_drafts
            self.draft_tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens


def run_once(llm, counter: SpecCounter | None, prompts, params) -> Run:  # noqa: ANN001
    before = (counter.drafts, counter.draft_tokens, counter.accepted) if counter else None
    cpu, wall = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    itls, tokens = [], 0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        tokens += n
        m = o.metrics
        itls.append((m.last_token_time - m.first_token_time) / max(n - 1, 1))
    acc = mean_len = None
    if counter is not None and before is not None:
        drafts = counter.drafts - before[0]
        draft_tokens = counter.draft_tokens - before[1]
        accepted = counter.accepted - before[2]
        acc = accepted / draft_tokens if draft_tokens else 0.0
        mean_len = 1 + accepted / drafts if drafts else 1.0
    llm.llm_engine.block_manager.reset_prefix_cache()
    return Run(1e3 * statistics.mean(itls), 1e3 * cpu / tokens, wall, acc, mean_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=default_model_dir())
    ap.add_argument("--workloads", default="copy,random,random-sampled")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams

    model_dir = build_bench_model(args.model_dir)
    common = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28, max_num_seqs=8)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 5}
    plain = LLM(str(model_dir), **common)
    spec = LLM(str(model_dir), speculative_config=spec_config, **common)
    counter = SpecCounter()
    spec.llm_engine.add_stat_logger(counter)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    for llm in (plain, spec):
        llm.generate([make_prompts("random", 1, seed=99)[0]], warm, use_tqdm=False)

    rows = []
    for workload in args.workloads.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = make_prompts(workload, batch)
            params = SamplingParams(
                temperature=1.0 if workload == "random-sampled" else 0.0,
                seed=0 if workload == "random-sampled" else None,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                detokenize=False,
            )
            base_runs, spec_runs = [], []
            for r in range(args.repeats):
                order = [(plain, None, base_runs), (spec, counter, spec_runs)]
                for llm, cnt, sink in order if r % 2 == 0 else order[::-1]:
                    sink.append(run_once(llm, cnt, prompts, params))
            rows.append(summarise(workload, batch, base_runs, spec_runs))
            print(rows[-1], flush=True)
    table = render(rows, args)
    print(table)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(table + "\n")


def summarise(workload: str, batch: int, base: list[Run], spec: list[Run]) -> str:
    b_itl = statistics.median(r.itl_ms for r in base)
    s_itl = statistics.median(r.itl_ms for r in spec)
    b_cpu = statistics.median(r.cpu_ms_per_token for r in base)
    s_cpu = statistics.median(r.cpu_ms_per_token for r in spec)
    acc = statistics.median(r.acceptance or 0.0 for r in spec)
    mlen = statistics.median(r.mean_accepted_len or 1.0 for r in spec)
    return (
        f"| {workload} | {batch} | {b_itl:.1f} | {s_itl:.1f} | {b_itl / s_itl:.2f}x | "
        f"{b_cpu:.1f} | {s_cpu:.1f} | {b_cpu / s_cpu:.2f}x | {100 * acc:.0f}% | {mlen:.2f} |"
    )


def render(rows: list[str], args: argparse.Namespace) -> str:
    head = (
        f"\nn-gram k={args.k}, {args.max_tokens} output tokens per request, median of "
        f"{args.repeats} alternating runs; {machine()}\n\n"
        "| workload | batch | plain ms/token | spec ms/token | speed-up | plain CPU ms/token "
        "| spec CPU ms/token | CPU speed-up | acceptance | mean acceptance length |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    return "\n".join([head, *rows])


if __name__ == "__main__":
    main()

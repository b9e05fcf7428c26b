"""The same decode workloads on two source trees, taking turns: is a change slower?

    git worktree add --detach /tmp/base <commit>
    python benchmarks/ab_trees.py --trees /tmp/base/src src \\
        --model ~/.cache/pagedllm/smollm2-135m-instruct/hf-fp32 --rounds 2

Per tree, dtype and round, a fresh process loads the model and measures batch-1 decode
(128-token prompt, 127 decode steps, best of 3, time to first token subtracted) and the output
tok/s of 32 requests (prompts of 96-344 tokens, 64 output tokens, greedy, ignore_eos). Trees
alternate within a round, so the machine's drift weighs on both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = "--child"


def measure(model: str, dtype: str) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, kv_cache_memory_bytes=1 << 30, max_num_seqs=64)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    prompt = {"prompt_token_ids": [(i * 7) % 5000 + 100 for i in range(128)]}
    llm.generate([prompt], params(8), use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], params(1), use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], params(128), use_tqdm=False)
        best = max(best, 127 / (time.perf_counter() - start - ttft))
    batch = [
        {"prompt_token_ids": [(i * 13 + j) % 5000 + 100 for i in range(96 + 8 * j)]}
        for j in range(32)
    ]
    llm.generate(batch[:4], params(4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(batch, params(64), use_tqdm=False)
    rate = 32 * 64 / (time.perf_counter() - start)
    return {"batch1_tok_s": round(best, 1), "batch32_out_tok_s": round(rate, 1)}


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, help="two src/ folders: old new")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()}")
    for r in range(1, args.rounds + 1):
        for dtype in args.dtypes:
            for tree in args.trees:
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, __file__, CHILD, args.model, dtype]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"round {r} {dtype:8} {tree}: {row}", flush=True)


if __name__ == "__main__":
    main()

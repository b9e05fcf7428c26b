"""One user's decode rate, taking turns: llama.cpp's llama-bench on a GGUF, then pagedllm on
each model with an environment switch off and on (or without and with an engine argument, or
another commit's code, then this tree's), each a fresh process, round after round.

A switch's effect on batch 1 is a few percent, and a shared guest's pace changes within
minutes, so the two sides of each pair run back to back and every round repeats the pair.
pagedllm: a 128-token prompt (--prompt-len), then 128 tokens, greedy; the best of 3 decode
rates of one process, with a hash of its tokens (the two sides of a pair must agree).
llama-bench decodes its 128 tokens after as many tokens of context (``-d``), as compare.py
runs it. With llama-bench, the end prints each model's median over the rounds of each side
against llama.cpp's figure of the same round.

    python benchmarks/batch1.py --llama-bench PATH --gguf Q4_1.gguf \\
        --model Q4_1.gguf:auto HF_FOLDER:bfloat16 HF_FOLDER:float32 \\
        --switch PAGEDLLM_CPU_HUGE_PAGES --rounds 3

Before and after a change: ``git worktree add ../base COMMIT``, then ``--against ../base``.
An engine argument: ``--engine-arg kv_cache_dtype=bfloat16``. Beside llama.cpp alone:
``--switch none``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402
from compare import llama_bench  # noqa: E402

PROMPT, OUTPUT, REPEATS = 128, 128, 3


def decode(
    model: str, dtype: str, quantization: str | None, extra: dict, prompt_len: int = PROMPT
) -> None:
    """This process: pagedllm's best decode rate of REPEATS requests, printed as JSON."""
    from pagedllm import LLM, SamplingParams

    kwargs = {"quantization": quantization} if quantization else {}
    llm = LLM(model, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=1, **kwargs, **extra)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT + 1, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    best, tokens = 0.0, []
    for r in range(REPEATS):
        prompt = [(7 * r + 13 * j) % 30000 + 3 for j in range(prompt_len)]
        engine.add_request(str(r), {"prompt_token_ids": prompt}, params)
        engine.step()  # the prompt, and the first token
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += out.outputs[0].token_ids
        # OUTPUT tokens decoded: one a step, or several (num_scheduler_steps)
        best = max(best, OUTPUT / (time.perf_counter() - start))
    digest = hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]
    print(json.dumps({"tok_s": best, "tokens": digest}))


def run_decode(
    model: str,
    dtype: str,
    quantization: str | None,
    env: dict,
    extra: dict | None = None,
    prompt_len: int = PROMPT,
) -> dict:
    argv = [sys.executable, __file__, "--decode", model, dtype, quantization or "",
            json.dumps(extra or {}), "--prompt-len", str(prompt_len)]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", nargs=4, help=argparse.SUPPRESS)  # one pagedllm process
    ap.add_argument("--model", nargs="+", default=[],
                    help="MODEL:DTYPE[:QUANTIZATION], a folder or GGUF file each")  # fmt: skip
    ap.add_argument("--switch", default="PAGEDLLM_CPU_HUGE_PAGES",
                    help="environment variable set to 0, then 1, for each model; 'none': "
                         "two runs of the same code a round")  # fmt: skip
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (optional)")
    ap.add_argument("--gguf", help="the GGUF llama-bench decodes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=PROMPT,
                    help="tokens of context before the 128 decoded: pagedllm's prompt, "
                         "llama-bench's -d")  # fmt: skip
    ap.add_argument("--against", metavar="DIR",
                    help="a checkout of another commit: each pair runs its pagedllm (DIR/src), "
                         "then this tree's, in place of --switch")  # fmt: skip
    ap.add_argument("--engine-arg", metavar="NAME=VALUE",
                    help="an engine argument the second of each pair runs with, in place of "
                         "--switch (e.g. kv_cache_dtype=bfloat16)")  # fmt: skip
    args = ap.parse_args()
    if args.decode:
        model, dtype, quantization, extra = args.decode
        return decode(model, dtype, quantization or None, json.loads(extra), args.prompt_len)
    engine_arg = {}
    if args.engine_arg:
        name, _, value = args.engine_arg.partition("=")
        try:  # numbers, true / false, null as JSON has them; anything else a string
            engine_arg[name] = json.loads(value)
        except json.JSONDecodeError:
            engine_arg[name] = value
    if not args.model:
        ap.error("--model is required")
    print(f"machine: {machine()}")
    print(f"load: {Path('/proc/loadavg').read_text().split()[:3]}")
    ratios: dict[tuple[str, str], list[float]] = {}  # (model, side): pagedllm / llama.cpp
    for r in range(1, args.rounds + 1):
        print(f"round {r} ({time.strftime('%H:%M:%S', time.gmtime())} UTC)", flush=True)
        rate = None
        if args.llama_bench and args.gguf:
            bench = llama_bench(
                Path(args.llama_bench), Path(args.gguf), 2, 0, OUTPUT, depth=args.prompt_len
            )
            rate = bench["decode_tok_s"]
            print(f"  llama.cpp {Path(args.gguf).name}: {rate:.1f} ({bench['command']})")
        for spec in args.model:
            model, dtype, *rest = spec.split(":")
            quantization = rest[0] if rest else None
            sides = {}
            for value in ("0", "1"):
                env, extra = dict(os.environ), {}
                if engine_arg:
                    extra = engine_arg if value == "1" else {}
                elif args.against:
                    if value == "0":  # the other checkout's package ahead of this tree's
                        path = [str(Path(args.against).resolve() / "src"), env.get("PYTHONPATH")]
                        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
                elif args.switch != "none":
                    env[args.switch] = value
                sides[value] = run_decode(model, dtype, quantization, env, extra, args.prompt_len)
            same = (
                "same tokens" if sides["0"]["tokens"] == sides["1"]["tokens"] else "TOKENS DIFFER"
            )
            off, on = sides["0"]["tok_s"], sides["1"]["tok_s"]
            names = (f"{args.switch}=0", "=1")
            if args.against:
                names = ("before", "after")
            elif engine_arg:
                names = ("default", args.engine_arg)
            elif args.switch == "none":
                names = ("first", "second")
            print(f"  {Path(model).name} {dtype} {quantization or ''}: {names[0]} {off:.1f}, "
                  f"{names[1]} {on:.1f} ({on / off:.2f}x, {same})", flush=True)  # fmt: skip
            if rate is not None:
                ratios.setdefault((spec, names[0]), []).append(off / rate)
                ratios.setdefault((spec, names[1]), []).append(on / rate)
    for (spec, side), values in ratios.items():
        print(
            f"{spec} {side} against llama.cpp, median of {len(values)} rounds: "
            f"{statistics.median(values):.2f}x (rounds {min(values):.2f}-{max(values):.2f}x)"
        )


if __name__ == "__main__":
    main()

"""Offline throughput: pagedllm vs Hugging Face transformers generate, same requests.

Like ``vllm bench throughput``: three workloads (uniform, mixed, shared-prefix chat) on the
125M Llama benchmark model (random weights, bf16). HF runs static batches (8 and 32); each
batch generates until its longest request is done, prompts left-padded. Throughput counts
only the tokens each request asked for. Prints a table and ratios to HF's better batch size,
and writes a bar chart.

    python benchmarks/throughput.py                      # all workloads
    python benchmarks/throughput.py --workloads uniform --hf-batch-sizes 32
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402


@dataclass
class Request:
    prompt: list[int]
    output_len: int


WORKLOADS = ("uniform", "mixed", "shared-prefix")


def make_workload(
    name: str, seed: int = 0, vocab: int = 32000, scale: float = 1.0
) -> list[Request]:
    """The issue's workloads; scale < 1 keeps that share of the requests (quick runs)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    count = lambda n: max(1, round(n * scale))  # noqa: E731
    if name == "uniform":
        return [Request(tok(128), 128) for _ in range(count(32))]
    if name == "mixed":
        return [Request(tok(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(count(64))]
    if name == "shared-prefix":
        system = tok(256)
        return [
            Request(system + tok(rng.randint(16, 64)), rng.randint(32, 128))
            for _ in range(count(64))
        ]
    raise ValueError(f"unknown workload {name!r}")


def run_pagedllm(model_dir: Path, reqs: list[Request], engine_kwargs: dict) -> tuple[float, dict]:
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model_dir), skip_tokenizer_init=True, **engine_kwargs)
    ready = time.perf_counter() - start
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
        for r in reqs
    ]
    llm.generate([reqs[0].prompt[:8]], params[0].clone_for_child(0), use_tqdm=False)  # warm-up
    llm.llm_engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
    bm = llm.llm_engine.block_manager
    info = {
        "ready_s": ready,
        "prefix_hits": bm.prefix_cache_hits,
        "preemptions": llm.llm_engine.scheduler.num_preemptions,
    }
    return elapsed, info


def run_hf(
    model_dir: Path, reqs: list[Request], batch_size: int, dtype: str, warmup: bool = False
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    pad = 0
    if warmup:  # one short batch first: allocator, oneDNN primitives, lazy imports
        with torch.inference_mode():
            ids = torch.tensor([reqs[0].prompt[:16]] * min(batch_size, len(reqs)))
            model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + new
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: build 125M)")
    ap.add_argument("--workloads", nargs="+", default=["uniform", "mixed", "shared-prefix"])
    ap.add_argument("--hf-batch-sizes", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--dtype", default="bfloat16", help="dtype of both engines")
    ap.add_argument("--plot", default="docs/throughput.png", help="bar chart PNG ('' for none)")
    ap.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    args = ap.parse_args()
    model_dir = args.model or build_bench_model(default_model_dir())
    engine_kwargs = dict(
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
    )
    print(f"machine: {machine()}\nmodel: {model_dir}\nengine: {engine_kwargs}")
    results = {}
    for name in args.workloads:
        reqs = make_workload(name)
        out_tokens = sum(r.output_len for r in reqs)
        total_tokens = out_tokens + sum(len(r.prompt) for r in reqs)
        t_ours, info = run_pagedllm(model_dir, reqs, engine_kwargs)
        print(f"[{name}] pagedllm {t_ours:.1f} s, {out_tokens / t_ours:.1f} out tok/s", flush=True)
        hf = {}
        for bs in args.hf_batch_sizes:
            hf[bs] = run_hf(model_dir, reqs, bs, args.dtype)
            print(f"[{name}] HF batch {bs}: {hf[bs]:.1f} s", flush=True)
        best_bs = min(hf, key=hf.get)
        row = {
            "requests": len(reqs),
            "output_tokens": out_tokens,
            "total_tokens": total_tokens,
            "pagedllm_s": t_ours,
            "pagedllm_out_tok_s": out_tokens / t_ours,
            "pagedllm_total_tok_s": total_tokens / t_ours,
            **info,
            "hf_s": {str(k): v for k, v in hf.items()},
            "hf_best_batch": best_bs,
            "hf_out_tok_s": out_tokens / hf[best_bs],
            "ratio": hf[best_bs] / t_ours,
        }
        results[name] = row
        print(f"\n[{name}] {len(reqs)} requests, {out_tokens} output / {total_tokens} total tokens")
        print(
            f"  pagedllm     {t_ours:8.1f} s  {out_tokens / t_ours:8.1f} out tok/s  "
            f"{total_tokens / t_ours:8.1f} total tok/s  (ready in {info['ready_s']:.2f} s, "
            f"prefix hits {info['prefix_hits']}, preemptions {info['preemptions']})"
        )
        for bs, t in hf.items():
            print(
                f"  HF batch {bs:<3} {t:8.1f} s  {out_tokens / t:8.1f} out tok/s  "
                f"{total_tokens / t:8.1f} total tok/s"
            )
        print(f"  ratio to HF (batch {best_bs}): {row['ratio']:.2f}x")
    print("\n| workload | pagedllm out tok/s | HF best out tok/s | ratio |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['pagedllm_out_tok_s']:.1f} | {r['hf_out_tok_s']:.1f} "
            f"(batch {r['hf_best_batch']}) | {r['ratio']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, Path(args.plot), args.dtype)


def plot(results: dict, path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    ours = [results[n]["pagedllm_out_tok_s"] for n in names]
    hf = [results[n]["hf_out_tok_s"] for n in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], hf, width=0.4, label="HF transformers (best static batch)")
    ax.bar([i + 0.2 for i in x], ours, width=0.4, label="pagedllm")
    for i, n in enumerate(names):
        ax.text(i + 0.2, ours[i], f"{results[n]['ratio']:.1f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"125M Llama, {dtype}, CPU: offline throughput")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()

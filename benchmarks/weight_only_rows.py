"""A model's weight-only products at one row of x (or --rows), as a decode step runs them,
against another tree's kernel in the same process, taking turns.

    git worktree add --detach ../base <commit>
    python benchmarks/weight_only_rows.py --against ../base \\
        --model ~/.cache/pagedllm/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/weight_only_rows.py --against ../base --rows 48 --quantization int8 \\
        --model ~/.cache/pagedllm/smollm2-135m-instruct/hf-fp32     # its down_proj and head

The other tree's csrc/weight_only_gemm.cpp is built under its own op namespace, so both
kernels run on the same loaded weights (the GGUF file's blocks, each layer's x form: int8 x
for its layers, the residual form for its LM head). Per product kind (30 layers' weights in
turn, as a step streams them) and for the whole step's products, the best of --reps rounds on
1 and on 2 threads, this tree's weight bytes and multiply-adds a second, and the largest
difference between the two kernels' outputs of the kind's last product.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine, ops_of_tree  # noqa: E402


def load_against(tree: Path):  # noqa: ANN201
    """The weight_only_linear op of another tree's kernel, built under its own namespace (the
    flags weight_only.load builds with)."""
    source = "src/pagedllm/layers/csrc/weight_only_gemm.cpp"
    ops = ops_of_tree(tree, source, "pagedllm_wo", "wo_against", ["-O3", "-fopenmp"])
    return ops.weight_only_linear


def products(model: str, quantization: str | None) -> dict[str, list]:
    """The model's weight-only products by kind: (packed weight, x form) each."""
    from pagedllm import LLM
    from pagedllm.layers.weight_only import PackedWeight

    llm = LLM(model, skip_tokenizer_init=True, dtype="auto", max_num_seqs=1,
              quantization=quantization)  # fmt: skip
    kinds: dict[str, list] = {}
    for name, module in llm.llm_engine.model.named_modules():
        kernel = getattr(module, "quant_kernel", None)
        if isinstance(getattr(kernel, "packed", None), PackedWeight):
            kinds.setdefault(name.split(".")[-1], []).append((kernel.packed, kernel.x_form))
    if not kinds:
        raise SystemExit(f"{model}: no weight-only products (a GGUF file's blocks have them)")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file (or a weight-only folder)")
    parser.add_argument("--against", type=Path, required=True, metavar="DIR")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: a decode step's)")
    parser.add_argument("--quantization", default=None, help="for a folder: int8 / int4")
    args = parser.parse_args()
    from pagedllm.layers import weight_only

    against = load_against(args.against)
    kinds = products(args.model, args.quantization)
    ops = {args.against.name: against, "this tree": torch.ops.pagedllm_wo.weight_only_linear}
    print(f"{machine()}; {cpu_flags()}; {load_average()}; {args.rows} rows of x")
    print("| threads | products | " + " | ".join(f"{n} ms" for n in ops) + " | speed-up | "
          "GB/s | GMAC/s | max diff |\n|---|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    kinds["the step"] = [item for items in kinds.values() for item in items]
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for kind, items in kinds.items():
                x = {k: torch.randn(args.rows, k) for k in {w.shape[1] for w, _ in items}}
                best, out = dict.fromkeys(ops, float("inf")), {}
                for _ in range(args.reps):
                    for name, op in ops.items():
                        start = time.perf_counter()
                        for w, form in items:
                            y = op(x[w.shape[1]], w.qweight, w.scale, w.offset, w.bits, None,
                                   weight_only.ROW_X_FORMS[form])  # fmt: skip
                        best[name] = min(best[name], time.perf_counter() - start)
                        out[name] = y
                base, new = best.values()
                diff = (out[args.against.name] - out["this tree"]).abs().max().item()
                nbytes = sum(w.nbytes() for w, _ in items)
                macs = args.rows * sum(w.shape[0] * w.shape[1] for w, _ in items)
                print(f"| {threads} | {kind} x{len(items)} | {base * 1e3:.3f} | {new * 1e3:.3f} "
                      f"| {base / new:.2f}x | {nbytes / new / 1e9:.1f} | {macs / new / 1e9:.1f} "
                      f"| {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()

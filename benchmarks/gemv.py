"""One-row products of a model's shapes: F.linear against pagedllm's C++ GEMV.

Runs the model's one-row products (its layers' qkv, o, gate_up and down, then the LM head)
back to back, each weight its own tensor, so the weights stream from memory as in a decode
step, and prints the weight bytes per second of each path (best of 5 rounds).

    python benchmarks/gemv.py                                  # the 125M benchmark model
    python benchmarks/gemv.py --shapes smollm2 --dtype bfloat16 --against ../base

With --against DIR, in place of F.linear: DIR's csrc/fused_ops.cpp built beside this tree's
under another op namespace, the two GEMVs taking turns in one process on the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import BENCH_125M, cpu_flags, load_average, machine, ops_of_tree  # noqa: E402
from compare import linear_shapes  # noqa: E402

from pagedllm.layers import cpu_fused  # noqa: E402

SHAPES = {
    "125m": BENCH_125M,
    "smollm2": {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152},
}  # fmt: skip


def gemv_of_tree(tree: Path):  # noqa: ANN201
    """The gemv op of another tree's fused ops, built under its own namespace (the flags
    cpu_fused.load builds with)."""
    from pagedllm.cpp_build import arch_flags

    flags = ["-O3", "-fopenmp", "-ffp-contract=off", *arch_flags()]
    source = "src/pagedllm/layers/csrc/fused_ops.cpp"
    return ops_of_tree(tree, source, "pagedllm_fused", "fused_against", flags).gemv


def per_step(products: list, fn) -> float:  # noqa: ANN001
    """Seconds for all products once, best of 5 rounds of 10."""
    for w, x in products:
        fn(x, w)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            for w, x in products:
                fn(x, w)
        best = min(best, (time.perf_counter() - start) / 10)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="125m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--against", type=Path, default=None, metavar="DIR")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: turns each")
    args = parser.parse_args()
    if not cpu_fused.load():
        raise SystemExit("the C++ fused ops could not be built")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{machine()}; {cpu_flags()}; {load_average()}; {torch.get_num_threads()} threads")
    shapes = [(n, k) for n, k, layers in linear_shapes(SHAPES[args.shapes]).values()
              for _ in range(layers)]  # fmt: skip
    paths = {"C++ GEMV": lambda x, w: cpu_fused.gemv(x, w, None)}
    if args.against is None:
        paths = {"F.linear": lambda x, w: F.linear(x, w), **paths}
    else:
        against = gemv_of_tree(args.against)
        paths = {f"C++ GEMV @{args.against.name}": lambda x, w: against(x, w, None), **paths}
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name)
            products = [(torch.randn(n, k).to(dtype), torch.randn(1, k).to(dtype))
                        for n, k in shapes]  # fmt: skip
            nbytes = sum(w.numel() * w.element_size() for w, _ in products)
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds if args.against else 1):
                for path, fn in paths.items():
                    best[path] = min(best[path], per_step(products, fn))
            for path, seconds in best.items():
                print(f"{name:9s} {path:20s} {len(products)} products, {nbytes / 1e6:.0f} MB: "
                      f"{seconds * 1e3:6.2f} ms, {nbytes / seconds / 1e9:5.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()

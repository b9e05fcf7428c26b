"""One-row products at the 125M benchmark model's shapes: F.linear against pagedllm's C++ GEMV.

Runs the model's 49 one-row products (12 layers x qkv, o, gate_up, down, and the LM head)
back to back, each weight its own tensor, so the weights stream from memory as in a decode
step, and prints the weight bytes per second of each path (best of 5 rounds).

    python benchmarks/gemv.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402
from compare import linear_shapes  # noqa: E402

from pagedllm.layers import cpu_fused  # noqa: E402


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
    if not cpu_fused.load():
        raise SystemExit("the C++ fused ops could not be built")
    print(machine())
    shapes = [(n, k) for n, k, layers in linear_shapes().values() for _ in range(layers)]
    for dtype in (torch.float32, torch.bfloat16):
        products = [(torch.randn(n, k).to(dtype), torch.randn(1, k).to(dtype)) for n, k in shapes]
        nbytes = sum(w.numel() * w.element_size() for w, _ in products)
        for name, fn in (
            ("F.linear", lambda x, w: F.linear(x, w)),
            ("C++ GEMV", lambda x, w: cpu_fused.gemv(x, w, None)),
        ):
            seconds = per_step(products, fn)
            print(f"{str(dtype):15s} {name:9s} {len(products)} products, {nbytes / 1e6:.0f} MB: "
                  f"{seconds * 1e3:6.2f} ms, {nbytes / seconds / 1e9:5.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()

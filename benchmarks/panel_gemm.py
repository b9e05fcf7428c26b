"""A decode step's products at a model's shapes, 1-256 rows: plain weights against panels.

For each row count, every linear product of the model (layers x qkv, o, gate_up, down; each
weight its own tensor, so the weights stream from memory as in a decode step) and, apart, the
LM head, through:

* plain: what a plain [N, K] weight runs (pagedllm's C++ GEMV at one row, else F.linear, or
  its bf16 form for a CPU without AVX-512: cpu_fused.float_linear);
* oneDNN prepacked: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once for
  the row count (what inductor's freezing uses; a second copy of every weight);
* panels: pagedllm's panel GEMM (layers/panel_gemm.py), the layout the loader keeps.

Prints ms per step, GFLOP/s and panels as a share of the faster of the other two (the
machine's rate at the same shapes), median of 7 rounds; then the weight-only int4 / int8
products by rows and in panels where the CPU runs those (AVX-512F); and writes the markdown
tables.

    python benchmarks/panel_gemm.py [--model FOLDER] [--markdown benchmarks/results/panel_gemm.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import load_average, machine  # noqa: E402
from compare import default_smollm2_folder, linear_shapes  # noqa: E402

from pagedllm.layers import cpu_fused, panel_gemm, weight_only  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def median_seconds(fn, rounds: int = 7) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[rounds // 2]


def measure(weights: list[torch.Tensor], panels: list[torch.Tensor], rows: int) -> dict[str, float]:
    """ms per step for each path over products with these weights at this row count (oneDNN
    nan where it does not prepack this dtype on this CPU: bf16 without AVX-512)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    try:
        prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    except RuntimeError:
        prepacked = None
    pointwise = torch.ops.mkldnn._linear_pointwise

    def plain() -> None:
        for w in weights:
            x = xs[w.shape[1]]
            cpu_fused.gemv(x, w, None) if rows == 1 else cpu_fused.float_linear(x, w, None)

    def onednn() -> None:
        for w, p in zip(weights, prepacked):
            pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def in_panels() -> None:
        for w, p in zip(weights, panels):
            panel_gemm.linear(xs[w.shape[1]], p, None)

    paths = (("plain", plain), ("onednn", onednn if prepacked else None), ("panels", in_panels))
    return {name: median_seconds(fn) * 1e3 if fn else math.nan for name, fn in paths}


def products(xs: dict[int, torch.Tensor], weights: list) -> None:
    for w in weights:
        weight_only.linear(xs[w.shape[1]], w, None)


def quantized_table(shapes: list[tuple[int, int]], row_counts: list[int]) -> list[str]:
    """Weight-only products (int4 group 32 as Q4_1, int8 with one scale per row as the default
    int8's down_proj) by rows (weight_only_gemm.cpp) and in panels, x in fp32 and bf16."""
    lines = [
        "| weight-only | x | rows | by rows ms | in panels ms | panels / rows |",
        "|---|---|---|---|---|---|",
    ]
    for bits in (4, 8):
        by_rows = [weight_only.quantize(torch.randn(n, k), bits, 32 if bits == 4 else k)
                   for n, k in shapes]  # fmt: skip
        in_panels = [weight_only.in_panels(w) for w in by_rows]
        for rows in row_counts:
            for dtype in (torch.float32, torch.bfloat16):
                xs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
                ms = [median_seconds(lambda ws=ws, xs=xs: products(xs, ws)) * 1e3
                      for ws in (by_rows, in_panels)]  # fmt: skip
                line = (f"| int{bits} | {str(dtype)[6:]} | {rows} | {ms[0]:.2f} | {ms[1]:.2f} | "
                        f"{ms[0] / ms[1]:.2f}x |")  # fmt: skip
                print(line, flush=True)
                lines.append(line)
    return lines


def main() -> None:
    args = parse_args()
    if not (cpu_fused.load() and panel_gemm.available()):
        raise SystemExit("the panel GEMM needs the C++ ops built and AVX-512F or AVX2 with FMA")
    torch.set_num_threads(args.threads)
    config = json.loads((args.model / "config.json").read_text())
    shapes = linear_shapes(config)
    layer_shapes = [(n, k) for name, (n, k, times) in shapes.items() if name != "lm_head"
                    for _ in range(times)]  # fmt: skip
    head = [shapes["lm_head"][:2]]
    header = [machine(), f"panel GEMM: {panel_gemm.isa()}", f"load at the start: {load_average()}"]
    print("\n".join(header))
    lines = [
        "| dtype | products | rows | plain ms | oneDNN prepacked ms | panels ms | panels GFLOP/s "
        "| panels / faster other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for label, group in ((f"{len(layer_shapes)} linear", layer_shapes), ("LM head", head)):
            flops_per_row = sum(2 * n * k for n, k in group)
            weights = [torch.randn(n, k).to(dtype) for n, k in group]
            panels = [panel_gemm.pack(w) for w in weights]
            for rows in args.rows:
                ms = measure(weights, panels, rows)
                rate = flops_per_row * rows / ms["panels"] / 1e6
                others = [t for t in (ms["plain"], ms["onednn"]) if not math.isnan(t)]
                share = min(others) / ms["panels"]
                cells = [str(dtype)[6:], label, rows, *(f"{ms[p]:.2f}" for p in ms)]
                line = "| " + " | ".join(map(str, [*cells, f"{rate:.0f}", f"{share:.2f}x"])) + " |"
                print(line, flush=True)
                lines.append(line)
    if panel_gemm.quantized_available():
        lines += ["", *quantized_table(layer_shapes, args.rows)]
    footer = f"load at the end: {load_average()}"
    print(footer)
    if args.markdown:
        command = "python benchmarks/panel_gemm.py " + " ".join(sys.argv[1:])
        model = f"- shapes: {args.model.name}'s config.json, {args.threads} threads"
        bullets = [*(f"- {h}" for h in header), f"- {footer}", model]
        text = "\n".join([f"`{command.strip()}`", "", *bullets, "", *lines, ""])
        args.markdown.write_text(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2's)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markdown", type=Path, default=None, help="write the table here too")
    args = p.parse_args()
    args.model = args.model or default_smollm2_folder()
    return args


if __name__ == "__main__":
    main()

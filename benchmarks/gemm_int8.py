"""int8 linear at decode sizes: the C++ few-row kernel against the oneDNN kernel (whole layer:
activation quantization, product, rescale) and fp32 F.linear, at the 125M model's shapes.

    python benchmarks/gemm_int8.py --threads 1 --rows 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_int8
from pagedllm.layers.quantization import OneDNNKernel, _cpu_has_vnni, quantize_weight

SHAPES = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
          "lm_head": (32000, 768)}  # fmt: skip


def per_call(fn, *args: object, seconds: float = 0.3) -> float:  # noqa: ANN001
    fn(*args)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(*args)
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_int8.load()
    levels = 127 if _cpu_has_vnni() else 63
    print(f"isa {cpu_int8.isa()}, levels {levels}, threads {torch.get_num_threads()}")
    observer = lambda x: x.abs().amax(dim=1, keepdim=True).float()  # noqa: E731
    for m in args.rows:
        totals = {"fp32": 0.0, "onednn": 0.0, "cpp": 0.0}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            q, scale = quantize_weight(w)
            module = torch.nn.Module()
            module.weight, module.weight_scale = q, scale
            onednn = OneDNNKernel(module, observer)
            packed, rowsum = cpu_int8.pack(q)
            x = torch.randn(m, k)
            times = {
                "fp32": per_call(F.linear, x, w),
                "onednn": per_call(onednn.mm, x),
                "cpp": per_call(cpu_int8.linear, x, packed, rowsum, scale, levels),
            }
            mult = 12 if name != "lm_head" else 1
            for key, t in times.items():
                totals[key] += mult * t
            print(
                f"rows {m:3d} {name:8s} "
                + "  ".join(f"{k} {v * 1e6:8.1f} us" for k, v in times.items())
            )
        print(f"rows {m:3d} model (12 layers + head): " + "  ".join(
            f"{k} {v * 1e3:6.2f} ms" for k, v in totals.items()))  # fmt: skip


if __name__ == "__main__":
    main()

"""SmolLM2's weight-only LM head at one decode row: x in fp32 against x in two int8 parts.

Loads the Q4_1 file (its Q8_0 head) and the HF folder quantized to int8 (a per-row int8
head) in each activation dtype, and times the 49,152 x 576 head at one row of x (a decoding
sequence; more rows take the fp32 path either way) through ``weight_only.linear`` with
x_form "float" and "int8_residual", the two interleaved call by call (neighbours on a shared
machine move both alike). Prints the median and best of each and the error of each against
the exact product on the dequantized weight. The two-part form runs on CPUs with AVX512-VNNI
and VBMI (weights in panels) or with AVX2 (codes by rows); a head without it is skipped.

    python benchmarks/lm_head.py [--calls 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine  # noqa: E402
from compare import default_smollm2_folder  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.layers import weight_only  # noqa: E402

FORMS = ("float", "int8_residual")


def time_head(head, x: torch.Tensor, calls: int) -> dict[str, list[float]]:  # noqa: ANN001
    seconds: dict[str, list[float]] = {f: [] for f in FORMS}
    for form in FORMS:  # warm-up
        weight_only.linear(x, head.packed, None, form)
    for _ in range(calls):
        for form in FORMS:
            start = time.perf_counter()
            weight_only.linear(x, head.packed, None, form)
            seconds[form].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=60, help="interleaved calls of each form")
    args = ap.parse_args()
    if not weight_only.int8_activations():
        raise SystemExit("this CPU runs no int8 activations: the head keeps x in fp32")
    from pagedllm.models.default_model import fetch_gguf

    print(f"machine: {machine()}; flags: {cpu_flags()}; {load_average()}")
    heads = {
        "Q4_1 file, Q8_0 head": {"model": str(fetch_gguf())},
        "int8, per-row head": {"model": str(default_smollm2_folder()), "quantization": "int8"},
    }
    for name, kwargs in heads.items():
        for dtype in ("bfloat16", "float32"):
            llm = LLM(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=16 << 20, **kwargs)
            head = llm.llm_engine.model.lm_head.quant_kernel
            if not weight_only.int8_activations_run(head.packed):
                print(f"{name}, {dtype} x: no int8 activations for this head here")
                del llm
                continue
            x = torch.randn(1, head.packed.shape[1]).to(getattr(torch, dtype))
            exact = x.double() @ head.packed.dequantize().double().T
            parts = []
            for form, seconds in time_head(head, x, args.calls).items():
                y = weight_only.linear(x, head.packed, None, form).double()
                error = ((y - exact).abs().max() / exact.abs().max()).item()
                parts.append(
                    f"{form} {statistics.median(seconds) * 1e3:.3f} ms "
                    f"(best {min(seconds) * 1e3:.3f}, error {error:.1e})"
                )
            print(f"{name}, {dtype} x: " + " | ".join(parts))
            del llm
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()

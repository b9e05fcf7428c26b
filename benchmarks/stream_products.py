"""How fast a one-row decode step's layer products stream their weights, against the machine.

Loads SmolLM2's Q4_1 file (the products as a decode step runs them: int4 codes in panels,
x rounded to int8 where the CPU has AVX512-VNNI) and times, on one and on two threads, the 120
layer products back to back with one row of bf16 x, each weight its own tensor (streamed from
memory, as in a step) and one layer's four products 30 times over (its 2.2 MB of weights kept
in cache). Beside them, the read bandwidth of one and two threads (``torch.sum`` over 256 MB).
Best of the rounds for each.

    python benchmarks/stream_products.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.layers import weight_only  # noqa: E402


def best_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    from pagedllm.models.default_model import fetch_gguf

    print(f"machine: {machine()}; flags: {cpu_flags()}; {load_average()}")
    llm = LLM(model=str(fetch_gguf()), dtype="bfloat16", max_model_len=256,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    kernels = [
        module.quant_kernel
        for layer in llm.llm_engine.model.model.layers
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]  # fmt: skip
    xs = {k.packed.shape[1]: torch.randn(1, k.packed.shape[1]).to(torch.bfloat16) for k in kernels}
    print(f"x form of the layers: {sorted({k.x_form for k in kernels})}")

    def run(group: list) -> Callable[[], None]:
        def products() -> None:
            for k in group:
                weight_only.linear(xs[k.packed.shape[1]], k.packed, None, k.x_form)

        return products

    in_cache = kernels[:4] * 30
    memory = torch.ones(64 << 20)  # 256 MB of fp32
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, group in (("120 products, from memory", kernels),
                             ("one layer's 4 x 30, in cache", in_cache)):  # fmt: skip
            seconds = best_seconds(run(group), args.rounds)
            weight_bytes = sum(k.packed.nbytes() for k in group)
            print(f"{threads} thread(s), {label}: {seconds * 1e3:.2f} ms, "
                  f"{weight_bytes / seconds / 1e9:.1f} GB/s")  # fmt: skip
        seconds = best_seconds(memory.sum, 10)
        rate = memory.nbytes / seconds / 1e9
        print(f"{threads} thread(s), torch.sum over 256 MB: {rate:.1f} GB/s")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()

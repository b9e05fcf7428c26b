"""How fast one thread reads a quantized weight in the orders a decode product can take.

Reads 256 MB (four buffers of 64 MB, from memory) with AVX-512 loads and no arithmetic in
three orders of the same bytes, as an int4 layer of K input features stores them
(csrc/panel_gemm.cpp's quantized panels: 16 outputs a panel, 16 bytes of codes and one fp16
scale and offset a block of 32 features per output):

* sequential: front to back (what ``torch.sum`` does);
* panel by panel: a group of 4 panels at a time, each panel's codes, scales and offsets
  contiguous, so a block step touches 4 code streams K / 2 * 16 bytes apart and 8 constant
  streams (the order before the panels were stored in groups);
* stored groups: the 4 panels' codes of a block side by side, the constants likewise, so a
  block step advances 3 streams (the order the kernel reads now).

    python benchmarks/read_patterns.py [--k 576 1536]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// order 0: sequential; 1: panel by panel; 2: stored groups (module docstring)
int64_t read_order(torch::Tensor buf, int64_t order, int64_t k) {
  const char* base = static_cast<const char*>(buf.data_ptr());
  const int64_t total = buf.numel(), blocks = k / 32;
  const int64_t code_panel = k / 2 * 16, const_panel = blocks * 32;  // bytes a panel
  const int64_t groups = total / (4 * (code_panel + 2 * const_panel));
  const char* codes = base;
  const char* scale = codes + groups * 4 * code_panel;
  const char* offset = scale + groups * 4 * const_panel;
  __m512i acc = _mm512_setzero_si512();
  auto add = [&](const char* p) { acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p)); };
  auto add32 = [&](const char* p) {
    acc = _mm512_xor_si512(acc, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)));
  };
  if (order == 0) {
    for (int64_t i = 0; i + 64 <= total; i += 64) add(base + i);
  } else {
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < 4; ++j) {
          const int64_t panel = 4 * g + j;
          const int64_t code = order == 1 ? panel * code_panel + b * 256
                                          : ((g * blocks + b) * 4 + j) * 256;
          const int64_t c = order == 1 ? panel * const_panel + b * 32
                                       : ((g * blocks + b) * 4 + j) * 32;
          for (int l = 0; l < 256; l += 64) add(codes + code + l);
          add32(scale + c);
          add32(offset + c);
        }
  }
  alignas(64) int64_t out[8];
  _mm512_store_si512(out, acc);
  return out[0] ^ out[7];
}
"""

ORDERS = ("sequential", "panel by panel", "stored groups")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[576, 1536], help="input features")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if "avx512f" not in cpu_flags():
        sys.exit("needs AVX-512F (the panel kernels' CPUs)")
    ext = load_inline(
        "pagedllm_read_patterns", cpp_sources=_SOURCE, functions=["read_order"],
        extra_cflags=["-O3", "-mavx512f"], verbose=False,
    )  # fmt: skip
    print(f"machine: {machine()}; flags: {cpu_flags()}; {load_average()}; one thread")
    buffers = [torch.randint(0, 255, (64 << 20,), dtype=torch.uint8) for _ in range(4)]
    for k in args.k:
        for order, name in enumerate(ORDERS):
            best = float("inf")
            for _ in range(args.rounds):
                for buf in buffers:  # each from memory: the other three evict it from L3
                    start = time.perf_counter()
                    ext.read_order(buf, order, k)
                    best = min(best, time.perf_counter() - start)
            print(f"K {k}, {name}: {buffers[0].numel() / best / 1e9:.1f} GB/s")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()

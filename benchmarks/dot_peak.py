"""The cores' own ceiling for a product: how fast they retire the multiply-add instruction
each kernel is built on, with nothing else in the loop.

    python benchmarks/dot_peak.py [--threads 2] [--seconds 0.3]

For each instruction this CPU has (vdpbf16ps: the bf16 panels and attention; vfmadd231ps on
zmm / ymm: fp32; vpdpbusd: the int8 kernels), every thread runs 24 independent accumulators
(12 on ymm, which has 16 registers; more than latency x throughput on the cores seen so far)
through it for about --seconds, and the best of five rounds is printed as GFLOP/s (GOP/s for
int8), a multiply-add counted as two. A GEMM's rate over this is the share of the cores'
arithmetic it reaches; the GEMM rates that benchmarks/compare.py measures (torch's) are what a
library gets at the same shapes, a lower bar.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

// What the chains end at: read after each run, so that the compiler keeps every chain.
float sinks[256];

// Seconds for `steps` passes of `chains` independent `op`s on every thread (an OpenMP region
// in a function of the instruction's target: a lambda would not inherit it). Each chain starts
// from its own value (equal chains are one to the compiler) and all of them are summed into
// `sinks` at the end.
#define PEAK(fn, isa, V, chains, start_at, add, op, first)                              \
  __attribute__((target(isa))) double fn(int64_t steps) {                               \
    const double start = omp_get_wtime();                                               \
    _Pragma("omp parallel num_threads(at::get_num_threads())") {                       \
      V acc[chains];                                                                    \
      for (int i = 0; i < chains; ++i) acc[i] = start_at(i);                            \
      for (int64_t s = 0; s < steps; ++s) {                                             \
        _Pragma("GCC unroll 24") for (int i = 0; i < chains; ++i) acc[i] = op(acc[i]);  \
      }                                                                                 \
      V all = acc[0];                                                                   \
      for (int i = 1; i < chains; ++i) all = add(all, acc[i]);                          \
      sinks[omp_get_thread_num() % 256] = first(all);                                   \
    }                                                                                   \
    return omp_get_wtime() - start;                                                     \
  }

#define BF16_ONES ((__m512bh)_mm512_set1_epi32(0x3f803f80))
#define DP_BF16(c) _mm512_dpbf16_ps(c, BF16_ONES, BF16_ONES)
#define FMA_512(c) _mm512_fmadd_ps(_mm512_set1_ps(1e-9f), _mm512_set1_ps(1e-9f), c)
#define FMA_256(c) _mm256_fmadd_ps(_mm256_set1_ps(1e-9f), _mm256_set1_ps(1e-9f), c)
// vpdpbusd as an asm statement: GCC's builtin copied every sum to another register and to
// the stack on every pass (half the rate).
__attribute__((target("avx512f,avx512vnni"))) inline __m512 dp_busd(__m512 c) {
  const __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(1);
  asm("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
  return c;
}
#define DP_BUSD(c) dp_busd(c)
#define AT_512(i) _mm512_set1_ps(float(i))
#define AT_256(i) _mm256_set1_ps(float(i))
#define FIRST_512(v) _mm512_cvtss_f32(v)
#define FIRST_256(v) _mm256_cvtss_f32(v)

PEAK(dpbf16, "avx512f,avx512bf16", __m512, 24, AT_512, _mm512_add_ps, DP_BF16, FIRST_512)
PEAK(fma512, "avx512f", __m512, 24, AT_512, _mm512_add_ps, FMA_512, FIRST_512)
PEAK(fma256, "avx2,fma", __m256, 12, AT_256, _mm256_add_ps, FMA_256, FIRST_256)
PEAK(dpbusd, "avx512f,avx512vnni", __m512, 24, AT_512, _mm512_add_ps, DP_BUSD, FIRST_512)

// Seconds for `steps` passes of instruction `name` on every thread.
double run(const std::string& name, int64_t steps) {
  if (name == "vdpbf16ps") return dpbf16(steps);
  if (name == "vfmadd231ps-zmm") return fma512(steps);
  if (name == "vfmadd231ps-ymm") return fma256(steps);
  if (name == "vpdpbusd") return dpbusd(steps);
  TORCH_CHECK(false, "unknown instruction ", name);
}

double seconds(const std::string& name, int64_t steps) {
  const double took = run(name, steps);
  float all = 0;
  for (float v : sinks) all += v;
  return all == -1.f ? -took : took;  // never -1: the sums are used
}
"""

# instruction -> (the /proc/cpuinfo flags it needs, multiply-adds per instruction, chains of
# them a thread runs (the C++ side's), unit)
INSTRUCTIONS = {
    "vdpbf16ps": (("avx512_bf16",), 32, 24, "GFLOP/s"),
    "vfmadd231ps-zmm": (("avx512f",), 16, 24, "GFLOP/s"),
    "vfmadd231ps-ymm": (("avx2", "fma"), 8, 12, "GFLOP/s"),  # 16 ymm registers
    "vpdpbusd": (("avx512_vnni",), 64, 24, "GOP/s"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=0.3, help="a round's length")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        "pagedllm_dot_peak", cpp_sources=_SOURCE, functions=["seconds"],
        extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    flags = set(cpu_flags().split())
    print(f"{machine()}; {args.threads} threads; {load_average()}")
    print("| instruction | multiply-adds each | rate, all threads | a thread |")
    print("|---|---:|---:|---:|")
    for name, (needs, macs, chains, unit) in INSTRUCTIONS.items():
        if not flags.issuperset(needs):
            print(f"| {name} | {macs} | not on this CPU | |")
            continue
        steps = 1 << 16  # grown until a round takes about --seconds
        while (took := ext.seconds(name, steps)) < args.seconds / 4:
            steps *= 2
        steps = int(steps * args.seconds / took)
        best = min(ext.seconds(name, steps) for _ in range(5))
        rate = 2 * chains * macs * steps * args.threads / best / 1e9
        print(f"| {name} | {macs} | {rate:.1f} {unit} | {rate / args.threads:.1f} |")


if __name__ == "__main__":
    main()

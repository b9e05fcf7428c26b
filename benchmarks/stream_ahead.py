"""How far ahead a one-row float product should request its weight on this CPU.

A decode step of one user streams every float weight once; csrc/panel_gemm.cpp's row tiles
request each panel's stream some bytes ahead (1 KB on AMD before Zen 5 but none for float32
without AVX-512, none on Zen 5, 2 KB elsewhere:
``torch.ops.pagedllm_panel.stream_ahead_bytes(dtype=...)``). Two measurements, each taking
turns within one process, so that the machine's drifting memory bandwidth weighs on every
setting alike:

* ``--pattern``: the read pattern alone. A C++ loop over 512 MB of fp32 panels on 2 MB pages
  (two threads, static halves), four panels side by side as the kernel streams them, or one
  or two or eight, with no requests or requests 1, 2 or 4 KB ahead; every variant in turn, 12
  rounds, GB/s.
* ``--model``: a decoding engine. One request (or ``--users`` at once, the products' rows)
  decodes; every ``--block`` steps the distance switches to the next setting; the median step
  time of each setting's blocks and how many block pairs each won.

    python benchmarks/stream_ahead.py --pattern [--k 576]
    python benchmarks/stream_ahead.py --model ~/.cache/pagedllm/smollm2-135m-instruct/hf-fp32 \\
        --dtype float32 [--settings 0 1024 2048] [--steps 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import load_average, machine  # noqa: E402

_PATTERN_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <vector>

namespace {
float* weights = nullptr;
int64_t floats = 0;

// panels of 16 outputs x k, nr of them side by side; requests `ahead` bytes ahead in each
template <int NR, int AHEAD>
__attribute__((target("avx512f"))) float stream(const float* w, int64_t panels, int64_t k,
                                                const float* x) {
  __m512 total = _mm512_setzero_ps();
  const int64_t panel = k * 16, lines = AHEAD / 64;
  for (int64_t p = 0; p + NR <= panels; p += NR) {
    __m512 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
    const float* g = w + p * panel;
    for (int64_t s = 0; s < k; ++s) {
      if constexpr (AHEAD > 0)
        for (int j = 0; j < NR; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(g + j * panel + (s + lines) * 16),
                       _MM_HINT_T1);
      const __m512 a = _mm512_set1_ps(x[s]);
      for (int j = 0; j < NR; ++j)
        acc[j] = _mm512_fmadd_ps(a, _mm512_loadu_ps(g + j * panel + s * 16), acc[j]);
    }
    for (int j = 0; j < NR; ++j) total = _mm512_add_ps(total, acc[j]);
  }
  return _mm512_reduce_add_ps(total);
}

template <int NR, int AHEAD>
double run(int64_t k) {
  const int64_t half = floats / (k * 16) / 2 / 8 * 8;  // panels a thread, whole groups
  const std::vector<float> x(k, 1.0f);
  double sum = 0;
#pragma omp parallel num_threads(2) reduction(+ : sum)
  sum += stream<NR, AHEAD>(weights + omp_get_thread_num() * half * k * 16, half, k, x.data());
  return sum;
}
}  // namespace

int64_t setup(int64_t bytes) {
  void* p = mmap(nullptr, bytes + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "mmap");
  char* a = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + (2 << 20) - 1) &
                                    ~uintptr_t((2 << 20) - 1));
  madvise(a, bytes, MADV_HUGEPAGE);
  weights = reinterpret_cast<float*>(a);
  floats = bytes / 4;
  for (int64_t i = 0; i < floats; ++i) weights[i] = 1e-3f * float(i % 7);
  return floats;
}

double variant(int64_t v, int64_t k) {
  switch (v) {
    case 0: return run<4, 0>(k);
    case 1: return run<4, 1024>(k);
    case 2: return run<4, 2048>(k);
    case 3: return run<4, 4096>(k);
    case 4: return run<1, 0>(k);
    case 5: return run<1, 1024>(k);
    case 6: return run<2, 1024>(k);
    default: return run<8, 1024>(k);
  }
}

TORCH_LIBRARY(pagedllm_stream_pattern, m) {
  m.def("setup", &setup);
  m.def("variant", &variant);
}
"""
VARIANTS = ["4 panels, none", "4 panels, 1 KB ahead", "4 panels, 2 KB ahead",
            "4 panels, 4 KB ahead", "1 panel, none", "1 panel, 1 KB ahead",
            "2 panels, 1 KB ahead", "8 panels, 1 KB ahead"]  # fmt: skip
PATTERN_BYTES = 512 << 20


def pattern(k: int, rounds: int) -> None:
    from torch.utils.cpp_extension import load_inline

    load_inline("pagedllm_stream_pattern", cpp_sources=_PATTERN_SOURCE,
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False)  # fmt: skip
    ops = torch.ops.pagedllm_stream_pattern
    ops.setup(PATTERN_BYTES)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for v, name in enumerate(VARIANTS):
            start = time.perf_counter()
            ops.variant(v, k)
            seconds[name].append(time.perf_counter() - start)
    print(f"read pattern, K = {k}, {PATTERN_BYTES >> 20} MB, 2 threads, {rounds} rounds")
    print("| panels side by side, requests | median GB/s | best GB/s |\n|---|---:|---:|")
    for name, s in seconds.items():
        print(f"| {name} | {PATTERN_BYTES / statistics.median(s) / 1e9:.1f} "
              f"| {PATTERN_BYTES / min(s) / 1e9:.1f} |")  # fmt: skip


def engine(
    model: str, dtype: str, settings: list[int], steps: int, block: int, users: int = 1
) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=users)
    eng = llm.llm_engine
    choose = torch.ops.pagedllm_panel.stream_ahead_bytes
    print(f"this CPU's distance: float32 {choose()} bytes, bfloat16 "
          f"{choose(dtype=torch.bfloat16)} bytes")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=block, ignore_eos=True, detokenize=False)
    blocks: dict[int, list[float]] = {s: [] for s in settings}
    prompt = [(13 * j) % 30000 + 3 for j in range(128)]
    for b in range(steps // block):
        setting = settings[b % len(settings)]
        choose(setting)
        for u in range(users):
            eng.add_request(f"{b}-{u}", {"prompt_token_ids": prompt[u:] + prompt[:u]}, params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or (
            eng.scheduler.waiting
        ):
            eng.step()  # the prompts
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        blocks[setting].append((time.perf_counter() - start) / (block - 1))
    base = settings[0]
    who = "one user" if users == 1 else f"{users} users at once"
    print(f"{model} ({dtype}), {who}, {block - 1} decode steps a block")
    print("| bytes ahead | blocks | median ms a step | blocks faster than the first setting's "
          "beside it |\n|---:|---:|---:|---:|")  # fmt: skip
    for s, times in blocks.items():
        wins = sum(t < u for t, u in zip(times, blocks[base]))
        won = "" if s == base else f"{wins} of {min(len(times), len(blocks[base]))}"
        print(f"| {s} | {len(times)} | {1e3 * statistics.median(times):.3f} | {won} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", action="store_true", help="the read pattern alone")
    ap.add_argument("--k", type=int, default=576, help="--pattern: input features of a panel")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--model", help="a folder or GGUF file to decode with")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--settings", type=int, nargs="+", default=[0, 1024, 2048],
                    help="--model: the distances to take turns with, bytes")  # fmt: skip
    ap.add_argument("--steps", type=int, default=2048, help="--model: decode steps in all")
    ap.add_argument("--block", type=int, default=33, help="--model: tokens a block decodes")
    ap.add_argument("--users", type=int, default=1,
                    help="--model: requests decoding at once (rows of each product)")  # fmt: skip
    args = ap.parse_args()
    if not args.pattern and not args.model:
        ap.error("--pattern or --model")
    torch.set_num_threads(2)
    print(f"machine: {machine()}; {load_average()}")
    if args.pattern:
        pattern(args.k, args.rounds)
    if args.model:
        engine(args.model, args.dtype, args.settings, args.steps, args.block, args.users)
    print(f"{load_average()} at the end")


if __name__ == "__main__":
    main()

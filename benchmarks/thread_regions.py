"""What the thread pool's regions cost a decode step, and what one region a step would save.

Every C++ product and attention call of a CPU step starts and joins its own OpenMP region
(torch's ``at::parallel_for``). One persistent region a step, with a barrier where each
kernel's region now starts, would trade each start and join for a barrier. Two measurements
give that trade's size on this machine:

* the harness: ``at::parallel_for`` over every thread with an empty body, back to back and
  after the calling thread streamed ``--stream-mb`` MB (as a product's weight passes through
  the caches), beside a spin barrier and libgomp's barrier inside one region; microseconds
  each, every round printed;
* ``--model``: the regions of one user's decode steps, counted by a shim library preloaded
  around libgomp's ``GOMP_parallel`` (the script runs itself again with it), and the steps'
  time; with the harness's figures, the most one region a step could save.

    python benchmarks/thread_regions.py [--rounds 3]
    python benchmarks/thread_regions.py --model ~/.cache/pagedllm/smollm2-135m-instruct/hf-fp32 \\
        --quantization int8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import load_average, machine  # noqa: E402

_HARNESS_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <vector>

namespace {
volatile int64_t sink;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// us per at::parallel_for over every thread, its body empty; `mb` > 0: the calling thread
// reads that many MB first (not timed)
double fork_join(int64_t calls, int64_t mb) {
  std::vector<int64_t> stream(mb << 17, 1);
  double total = 0;
  for (int64_t c = 0; c < calls; ++c) {
    int64_t sum = 0;
    for (size_t i = 0; i < stream.size(); i += 8) sum += stream[i];
    sink = sum;
    const double start = now();
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t t0, int64_t) { sink = t0; });
    total += now() - start;
  }
  return total / calls * 1e6;
}

// us per barrier of every thread inside one region: a sense-reversing spin barrier
double spin_barrier(int64_t rounds) {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> sense{0};
  const int threads = at::get_num_threads();
  const double start = now();
#pragma omp parallel num_threads(threads)
  {
    int mine = 0;
    for (int64_t r = 0; r < rounds; ++r) {
      mine ^= 1;
      if (arrived.fetch_add(1) == threads - 1) {
        arrived.store(0);
        sense.store(mine, std::memory_order_release);
      } else {
        while (sense.load(std::memory_order_acquire) != mine) relax();
      }
    }
  }
  return (now() - start) / rounds * 1e6;
}

// us per libgomp barrier inside one region
double omp_barrier(int64_t rounds) {
  const double start = now();
#pragma omp parallel num_threads(at::get_num_threads())
  for (int64_t r = 0; r < rounds; ++r) {
#pragma omp barrier
  }
  return (now() - start) / rounds * 1e6;
}
}  // namespace

TORCH_LIBRARY(pagedllm_thread_regions, m) {
  m.def("fork_join", &fork_join);
  m.def("spin_barrier", &spin_barrier);
  m.def("omp_barrier", &omp_barrier);
}
"""

_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>

static atomic_long calls;
static void (*next)(void (*)(void*), void*, unsigned, unsigned);

void GOMP_parallel(void (*fn)(void*), void* data, unsigned threads, unsigned flags) {
  if (!next) next = dlsym(RTLD_NEXT, "GOMP_parallel");
  atomic_fetch_add(&calls, 1);
  next(fn, data, threads, flags);
}

long gomp_parallel_calls(void) { return atomic_load(&calls); }
"""
_SHIM_ENV = "PAGEDLLM_THREAD_REGIONS_SHIM"


def harness(rounds: int, stream_mb: int) -> dict[str, list[float]]:
    """Each figure's microseconds, one a round."""
    from torch.utils.cpp_extension import load_inline

    load_inline("pagedllm_thread_regions", cpp_sources=_HARNESS_SOURCE,
                extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False)  # fmt: skip
    ops = torch.ops.pagedllm_thread_regions
    calls = {
        "fork/join, back to back": lambda: ops.fork_join(20000, 0),
        f"fork/join after {stream_mb} MB": lambda: ops.fork_join(2000, stream_mb),
        "spin barrier": lambda: ops.spin_barrier(200000),
        "libgomp barrier": lambda: ops.omp_barrier(200000),
    }
    figures: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            figures[name].append(call())
    print(f"{torch.get_num_threads()} threads, {rounds} rounds, us each:")
    for name, us in figures.items():
        print(f"  {name}: {', '.join(f'{u:.2f}' for u in us)}")
    return figures


def count_regions(model: str, dtype: str, quantization: str | None, steps: int) -> None:
    """Runs in the process the shim was preloaded into: a JSON line a run, its decode steps,
    regions a step and ms a step (the first run a warm-up)."""
    from pagedllm import LLM, SamplingParams

    shim = ctypes.CDLL(os.environ[_SHIM_ENV])
    llm = LLM(model, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=1,
              quantization=quantization)  # fmt: skip
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    prompt = {"prompt_token_ids": [(13 * j) % 30000 + 3 for j in range(128)]}
    for run in ("warm-up", "1", "2"):
        eng.add_request(run, prompt, params)
        eng.step()  # the prompt
        calls, decoded, start = shim.gomp_parallel_calls(), 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            decoded += 1
        ms = (time.perf_counter() - start) / decoded * 1e3
        regions = (shim.gomp_parallel_calls() - calls) / decoded
        print(json.dumps({"run": run, "steps": decoded, "regions": regions, "ms": ms}))


def regions_in_child(args: argparse.Namespace) -> tuple[float, float]:
    """Runs this script again with the shim preloaded; (regions a step, the faster timed
    run's ms a step)."""
    cmd = [sys.executable, __file__, "--count", "--model", args.model, "--dtype", args.dtype,
           "--steps", str(args.steps)]  # fmt: skip
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    with tempfile.TemporaryDirectory(prefix="pagedllm-regions-") as folder:
        source, shim = Path(folder) / "shim.c", Path(folder) / "libshim.so"
        source.write_text(_SHIM_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(source), "-o", str(shim), "-ldl"],
                       check=True)  # fmt: skip
        env = {**os.environ, "LD_PRELOAD": str(shim), _SHIM_ENV: str(shim)}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in runs:
        print(f"  {r['run']}: {r['steps']} decode steps, {r['regions']:.1f} regions a step, "
              f"{r['ms']:.3f} ms a step")  # fmt: skip
    timed = runs[1:]  # after the warm-up
    return timed[0]["regions"], min(r["ms"] for r in timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="harness rounds")
    p.add_argument("--stream-mb", type=int, default=4,
                   help="MB the calling thread reads before each timed region")  # fmt: skip
    p.add_argument("--model", help="also count a decoding engine's regions a step")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, help="e.g. int8")
    p.add_argument("--steps", type=int, default=128, help="decode steps a run")
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args()
    if args.count:
        return count_regions(args.model, args.dtype, args.quantization, args.steps)
    print(f"machine: {machine()}; {load_average()}")
    figures = harness(args.rounds, args.stream_mb)
    if args.model:
        print(f"one user's decode steps ({args.model}, {args.dtype}, "
              f"quantization {args.quantization}), a 128-token prompt:")  # fmt: skip
        regions, ms = regions_in_child(args)
        cold = statistics.median(figures[f"fork/join after {args.stream_mb} MB"])
        barrier = statistics.median(figures["spin barrier"])
        saved = regions * (cold - barrier) / 1e3
        print(f"one region a step would save at most {regions:.0f} x ({cold:.2f} - "
              f"{barrier:.2f}) us = {saved:.3f} ms of {ms:.3f} ({saved / ms:.1%})")  # fmt: skip
    print(f"{load_average()} at the end")


if __name__ == "__main__":
    main()

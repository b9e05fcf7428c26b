"""Attention kernels against a naive implementation and torch's SDPA, in one run.

    nice -n 5 python benchmarks/attention.py [--cases decode-125m,prefill-8x64-1024,...]
        [--reps 5] [--out benchmarks/results/attention.md]

Before and after a change to the C++ kernel, in one process, taking turns:

    git worktree add ../base COMMIT
    python benchmarks/attention.py --against ../base --threads 2 --layers 30 \
        --cases decode-smollm2-48,decode-smollm2-1,prefill-smollm2-4

Each case is a varlen batch (bf16, causal). Implementations:
  naive         materialised scores, masked softmax, every sequence padded to the longest
  sdpa/seq      torch.nn.functional.scaled_dot_product_attention, one sequence at a time, on
                contiguous K/V (no paging: it cannot read a block table)
  torch backend the engine's "torch" backend over the paged cache (block_size 16)
  cpu backend   the engine's "cpu" backend (C++ kernel) over the same paged cache
  flash_attn    pagedllm.attention.flash_attn_varlen_func on contiguous varlen K/V
With --against DIR, only the C++ kernel itself (its op, no backend around it): this tree's
build ("cpu kernel") and DIR's src/pagedllm/attention/csrc/attention.cpp built beside it under
another op namespace ("cpu kernel @DIR").
--layers N gives each call of the C++ kernel its own of N caches in turn, as a decode step's
layers do, so the keys come from memory rather than the caches (without --against it adds that
row, "cpu kernel", to the others). It also times "block gather", the memory floor of such a
call: the same threads reading every K/V block the block table names, whole (a sequence's K
blocks, then its V blocks; the threads take equal runs of that list; the blocks of a shared
prefix once), with no arithmetic, each block requested into L2 two blocks ahead. The kernel's
read rate is printed as a share of it:

    python benchmarks/attention.py --threads 2 --layers 30 --cases decode-smollm2-48

Times are the best of --reps runs (naive: one run), implementations interleaved so that they
share the machine's load. The ratios use CPU time of one thread (--threads 1, the default):
on a shared machine it is what the work costs, where wall time mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.attention import cpu_kernels, flash_attn_varlen_func, get_tuning
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, load_average, machine, ops_of_tree  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    key_lens: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    naive_head_chunk: int  # heads per naive pass, to bound its [B, h, Lq, Lk] scores
    shared: int = 0  # keys every sequence starts with, in the same blocks (a cached prefix)

    def blocks(self) -> list[int]:
        """Each sequence's blocks of the paged cache (BLOCK_SIZE keys each)."""
        return [-(-n // BLOCK_SIZE) for n in self.key_lens]

    def borrowed_blocks(self) -> list[int]:
        """Each sequence's first blocks that are the first sequence's (the shared prefix)."""
        return [self.shared // BLOCK_SIZE if i else 0 for i in range(len(self.key_lens))]

    def own_blocks(self) -> list[int]:
        """Each sequence's blocks besides those it borrows."""
        return [n - b for n, b in zip(self.blocks(), self.borrowed_blocks())]


def spread(n: int, lo: int, hi: int) -> list[int]:
    return [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]


SHARED_KEYS = [256 + n for n in spread(64, 40, 170)]
CASES = {
    c.name: c
    for c in [
        Case("decode-125m", [1] * 32, [300] * 32, 12, 4, 64, 12),
        Case("decode-16x64-2048", [1] * 16, spread(16, 64, 2048), 32, 8, 128, 32),
        Case("prefill-8x64-1024", spread(8, 64, 1024), spread(8, 64, 1024), 16, 4, 64, 16),
        Case("prefill-16x64-2048", spread(16, 64, 2048), spread(16, 64, 2048), 32, 8, 128, 2),
        # SmolLM2-135M's attention (9 query heads, 3 KV heads, d=64): the serving workload's
        # decode batch (48 sequences, prompts of 96-480 tokens plus their outputs), batch 1,
        # and a prefill chunk of four prompts
        Case("decode-smollm2-48", [1] * 48, spread(48, 100, 600), 9, 3, 64, 9),
        Case("decode-smollm2-1", [1], [330], 9, 3, 64, 9),
        Case("prefill-smollm2-4", [150, 200, 288, 400], [150, 200, 288, 400], 9, 3, 64, 9),
        # the shared-prefix workload's decode (benchmarks/throughput.py): 64 sequences behind
        # one cached 256-token prompt, with 40-170 keys of their own
        Case("decode-125m-shared", [1] * 64, SHARED_KEYS, 12, 4, 64, 12, shared=256),
        # and its prefill: the 64 prompts' own 16-64 tokens behind the cached 256
        Case(
            "prefill-125m-shared",
            spread(64, 16, 64),
            [256 + n for n in spread(64, 16, 64)],
            12,
            4,
            64,
            12,
            shared=256,
        ),
    ]
}
BLOCK_SIZE = 16


class Inputs:
    """One case's tensors: flat q/k/v, the paged cache holding the same K/V (and `layers` - 1
    copies of it, for the raw kernels), the metadata."""

    def __init__(self, case: Case, dtype: torch.dtype, layers: int = 1) -> None:
        g = torch.Generator().manual_seed(0)
        total_q, total_k = sum(case.query_lens), sum(case.key_lens)
        self.q = torch.randn(total_q, case.heads, case.head_dim, generator=g).to(dtype)
        self.k = torch.randn(total_k, case.kv_heads, case.head_dim, generator=g).to(dtype)
        self.v = torch.randn(total_k, case.kv_heads, case.head_dim, generator=g).to(dtype)
        self.cu_q = self._cu(case.query_lens)
        self.cu_k = self._cu(case.key_lens)
        for start in self.cu_k[1:-1].tolist():  # the shared prefix: the first sequence's keys
            self.k[start : start + case.shared] = self.k[: case.shared]
            self.v[start : start + case.shared] = self.v[: case.shared]
        blocks, own, borrowed = case.blocks(), case.own_blocks(), case.borrowed_blocks()
        ids = torch.randperm(sum(own), generator=g).int()  # shuffled like a used cache
        shape = (sum(own), BLOCK_SIZE, case.kv_heads, case.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)
        table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
        slots, new_rows, start = [], [], 0
        for i, (n_blocks, key_len, q_len) in enumerate(zip(blocks, case.key_lens, case.query_lens)):
            first = borrowed[i]
            table[i, :first] = table[0, :first]
            table[i, first:n_blocks] = ids[start : start + n_blocks - first]
            start += n_blocks - first
            pos = torch.arange(key_len)
            seq_slots = table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
            slots.append(seq_slots)
            new_rows.append(int(self.cu_k[i]) + key_len - q_len + torch.arange(q_len))
        all_slots = torch.cat(slots)
        self.k_cache.view(-1, *shape[2:])[all_slots] = self.k
        self.v_cache.view(-1, *shape[2:])[all_slots] = self.v
        self.caches = [(self.k_cache, self.v_cache)]
        self.caches += [(self.k_cache.clone(), self.v_cache.clone()) for _ in range(layers - 1)]
        self.table = table
        rows = torch.cat(new_rows)  # this step's tokens: the last query_len keys of each seq
        self.new_k, self.new_v = self.k[rows], self.v[rows]
        self.metadata = AttentionMetadata.paged(
            query_start_loc=self.cu_q,
            seq_lens=torch.tensor(case.key_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.cat([s[len(s) - q :] for s, q in zip(slots, case.query_lens)]),
            query_lens_cpu=list(case.query_lens),
            seq_lens_cpu=list(case.key_lens),
        )

    @staticmethod
    def _cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def naive(case: Case, x: Inputs, scale: float) -> torch.Tensor:
    """Pad every sequence to the longest, materialise the scores, mask, softmax.

    In fp32: torch's bf16 matmul on a CPU without bf16 units is many times slower than its
    fp32 one, and the baseline should not be slower than it needs to be."""
    batch, len_q, len_k = len(case.query_lens), max(case.query_lens), max(case.key_lens)
    group = case.heads // case.kv_heads
    q = torch.zeros(batch, len_q, case.heads, case.head_dim)
    k = torch.zeros(batch, len_k, case.kv_heads, case.head_dim)
    v = torch.zeros_like(k)
    for i, (nq, nk) in enumerate(zip(case.query_lens, case.key_lens)):
        q[i, :nq] = x.q[x.cu_q[i] : x.cu_q[i + 1]]
        k[i, :nk] = x.k[x.cu_k[i] : x.cu_k[i + 1]]
        v[i, :nk] = x.v[x.cu_k[i] : x.cu_k[i + 1]]
    q_len = torch.tensor(case.query_lens)[:, None, None]
    k_len = torch.tensor(case.key_lens)[:, None, None]
    pos = torch.arange(len_q)[None, :, None] + k_len - q_len  # [B, Lq, 1]
    key = torch.arange(len_k)[None, None, :]
    mask = (key <= pos) & (key < k_len)  # [B, Lq, Lk]
    out = torch.empty_like(q)
    k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))  # [B, H, Lk, D]
    for h in range(0, case.heads, case.naive_head_chunk):
        hs = slice(h, h + case.naive_head_chunk)
        scores = torch.matmul(q[:, :, hs].transpose(1, 2), k[:, hs].transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, hs] = torch.matmul(probs, v[:, hs]).transpose(1, 2)
    return torch.cat([out[i, :n] for i, n in enumerate(case.query_lens)]).to(x.q.dtype)


def sdpa_per_sequence(case: Case, x: Inputs, scale: float) -> torch.Tensor:
    outs = []
    for i, (nq, nk) in enumerate(zip(case.query_lens, case.key_lens)):
        q = x.q[x.cu_q[i] : x.cu_q[i + 1]].transpose(0, 1)[None]  # [1, H, n, D]
        k = x.k[x.cu_k[i] : x.cu_k[i + 1]].transpose(0, 1)[None]
        v = x.v[x.cu_k[i] : x.cu_k[i + 1]].transpose(0, 1)[None]
        # queries behind earlier keys (a chunk after a cached prefix) see them all: the mask's
        # diagonal at the end, as is_causal's is only for nq == nk; a lone decode query sees
        # every key and needs none
        mask = None
        if 1 < nq < nk:
            mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        attend = F.scaled_dot_product_attention
        o = attend(q, k, v, mask, is_causal=nq == nk, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def load_against(tree: Path) -> Callable:
    """The varlen_attention op of another tree's kernel source, built under its own namespace."""
    from pagedllm.cpp_build import arch_flags

    source = "src/pagedllm/attention/csrc/attention.cpp"
    flags = ["-O3", "-fopenmp", *arch_flags()]
    ops = ops_of_tree(tree, source, "pagedllm_attention", "attention_against", flags)
    return ops.varlen_attention


_GATHER_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

typedef uint64_t line_t __attribute__((vector_size(64)));

// Every block of `table` (rows: sequences, `blocks[b]` each), a sequence's K blocks then its V
// blocks, read whole: 64-byte lines folded together, each block's lines requested into L2 two
// blocks ahead. The threads take equal runs of the list.
int64_t gather_blocks(torch::Tensor k, torch::Tensor v, torch::Tensor table,
                      torch::Tensor blocks) {
  const int64_t block_bytes = k.stride(0) * k.element_size();
  const int32_t* t = table.data_ptr<int32_t>();
  const int64_t* n = blocks.data_ptr<int64_t>();
  std::vector<const char*> order;
  for (int64_t b = 0; b < table.size(0); ++b)
    for (const torch::Tensor* cache : {&k, &v})
      for (int64_t i = 0; i < n[b]; ++i)
        order.push_back(static_cast<const char*>(cache->data_ptr()) +
                        t[b * table.stride(0) + i] * block_bytes);
  const int64_t count = order.size();
  const int64_t share = (count + at::get_num_threads() - 1) / at::get_num_threads();
  std::vector<int64_t> folded(at::get_num_threads(), 0);
  at::parallel_for(0, count, share, [&](int64_t i0, int64_t i1) {
    line_t acc = {};
    for (int64_t i = i0; i < i1; ++i) {
      if (i + 2 < i1)
        for (int64_t l = 0; l < block_bytes; l += 64) __builtin_prefetch(order[i + 2] + l, 0, 2);
      for (int64_t l = 0; l < block_bytes; l += 64) {
        line_t line;
        std::memcpy(&line, order[i] + l, sizeof(line));
        acc ^= line;
      }
    }
    int64_t word = 0;
    for (int j = 0; j < 8; ++j) word ^= (int64_t)acc[j];
    folded[at::get_thread_num()] ^= word;
  });
  int64_t all = 0;
  for (int64_t w : folded) all ^= w;
  return all;
}
"""


def block_gather(case: Case, x: Inputs) -> Callable[[], None]:
    """The memory floor of a raw_kernel call: its K/V blocks read whole, no arithmetic (a
    shared prefix's blocks once)."""
    from torch.utils.cpp_extension import load_inline

    from pagedllm.cpp_build import arch_flags

    ext = load_inline(
        "pagedllm_block_gather", cpp_sources=_GATHER_SOURCE, functions=["gather_blocks"],
        extra_cflags=["-O3", "-fopenmp", *arch_flags()], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    own = case.own_blocks()
    table = torch.zeros_like(x.table)
    for i, (first, n) in enumerate(zip(case.borrowed_blocks(), own)):
        table[i, :n] = x.table[i, first : first + n]
    blocks = torch.tensor(own, dtype=torch.int64)
    calls = itertools.count()

    def run() -> None:
        k_cache, v_cache = x.caches[next(calls) % len(x.caches)]
        ext.gather_blocks(k_cache, v_cache, table, blocks)

    return run


def kv_bytes(case: Case, dtype: torch.dtype) -> int:
    """What one call reads of the paged cache: every K and V block, a shared one once."""
    return 2 * sum(case.own_blocks()) * BLOCK_SIZE * case.kv_heads * case.head_dim * dtype.itemsize


def raw_kernel(op: Callable, case: Case, x: Inputs) -> Callable[[], torch.Tensor]:
    """The C++ kernel's op on the paged cache, each call on the next of x's caches."""
    tiles = get_tuning("cpu", case.head_dim, case.heads // case.kv_heads, x.q.dtype)
    seq_lens = torch.tensor(case.key_lens, dtype=torch.int32)
    calls = itertools.count()

    def run() -> torch.Tensor:
        k_cache, v_cache = x.caches[next(calls) % len(x.caches)]
        out = torch.empty_like(x.q)
        op(
            x.q,
            k_cache,
            v_cache,
            out,
            x.cu_q,
            seq_lens,
            None,
            x.table,
            None,
            case.head_dim**-0.5,
            -1,
            0,
            tiles.block_m,
            tiles.block_n,
        )
        return out

    return run


def implementations(
    case: Case, x: Inputs, against: tuple[str, Callable] | None = None
) -> dict[str, Callable[[], torch.Tensor]]:
    if against is not None:
        name, op = against
        impls = {
            "naive": lambda: naive(case, x, case.head_dim**-0.5),
            "cpu kernel": raw_kernel(torch.ops.pagedllm_attention.varlen_attention, case, x),
            f"cpu kernel @{name}": raw_kernel(op, case, x),
        }
    else:
        impls = backends(case, x)
    if len(x.caches) > 1:  # keys from memory: the raw kernel over them, and their floor
        if "cpu kernel" not in impls:
            impls["cpu kernel"] = raw_kernel(torch.ops.pagedllm_attention.varlen_attention, case, x)
        impls[GATHER] = block_gather(case, x)
    return impls


def backends(case: Case, x: Inputs) -> dict[str, Callable[[], torch.Tensor]]:
    """The reference implementations and the engine's backends on x's first cache."""
    scale = case.head_dim**-0.5
    torch_backend, cpu_backend = TorchAttentionBackend(), CpuAttentionBackend()

    def backend(b):
        return lambda: b.forward(x.q, x.new_k, x.new_v, x.k_cache, x.v_cache, x.metadata, scale, -1)

    return {
        "naive": lambda: naive(case, x, scale),
        "sdpa/seq": lambda: sdpa_per_sequence(case, x, scale),
        "torch backend": backend(torch_backend),
        "cpu backend": backend(cpu_backend),
        "flash_attn": lambda: flash_attn_varlen_func(
            x.q, x.k, x.v, x.cu_q, x.cu_k, max(case.query_lens), max(case.key_lens), causal=True
        ),
    }


Timing = tuple[float, float]  # (CPU ms, wall ms)
GATHER = "block gather"  # a floor, not attention: no output to check


def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Timing]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, (1e3 * (time.process_time() - cpu), 1e3 * (time.perf_counter() - wall))


def measure(
    case: Case,
    reps: int,
    layers: int = 1,
    against: tuple[str, Callable] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Timing]:
    """Best of reps for each implementation (naive: its one reference run); with layers, a
    timing covers `layers` calls (one per cache)."""
    x = Inputs(case, dtype, layers)
    impls = implementations(case, x, against)
    calls = len(x.caches)
    with torch.inference_mode():
        want, naive_time = timed(impls.pop("naive"))
        best = {"naive": naive_time}
        for name, fn in impls.items():  # warm up, and check every result against naive
            out = fn()
            if name != GATHER:
                err = (out.float() - want.float()).abs().max().item()
                assert err < 5e-2, f"{case.name} {name}: max error {err}"
            best[name] = (float("inf"), float("inf"))
        for _ in range(reps):  # interleaved: every implementation sees the same load
            for name, fn in impls.items():
                _, (cpu, wall) = timed(lambda fn=fn: [fn() for _ in range(calls)][-1])
                best[name] = (min(best[name][0], cpu / calls), min(best[name][1], wall / calls))
    return best


def describe(case: Case, dtype: torch.dtype = torch.bfloat16) -> str:
    kind = "decode" if max(case.query_lens) == 1 else "prefill"
    lens = sorted(set(case.key_lens))
    ctx = f"{lens[0]}" if len(lens) == 1 else f"{lens[0]}-{lens[-1]}"
    return (
        f"{kind}: {len(case.key_lens)} seqs, {ctx} keys, {case.heads}/{case.kv_heads} heads, "
        f"d={case.head_dim}, {str(dtype).removeprefix('torch.')}, causal"
    )


def table(results: dict[str, dict[str, Timing]]) -> str:
    """CPU and wall ms a call; the ratios of CPU time against naive and sdpa/seq, or with
    --against, of wall time against the other tree's kernel (several threads: CPU time counts
    their spinning too)."""
    first = next(iter(results.values()))
    base = next((n for n in first if n.startswith("cpu kernel @")), None)
    last = f"vs {base}" if base else "vs sdpa/seq"
    lines = [
        f"| case | implementation | CPU ms | wall ms | vs naive | {last} |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case_name, times in results.items():
        for name, (cpu, wall) in times.items():
            ratio = times[base][1] / wall if base else times["sdpa/seq"][0] / cpu
            lines.append(
                f"| {case_name} | {name} | {cpu:.3f} | {wall:.3f} | "
                f"{times['naive'][0] / cpu:.2f}x | {ratio:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the table (markdown)")
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="another tree (a git worktree): its C++ kernel against this one's, taking turns",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="the C++ kernel's caches, taken in turn, one a call (30: a decode step of SmolLM2), "
        "and the block gather over the same blocks",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="q and the K/V cache's dtype",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        raise SystemExit("the C++ kernel did not build; nothing to compare")
    against = (args.against.name, load_against(args.against)) if args.against else None
    results: dict[str, dict[str, float]] = {}
    reads: list[str] = []  # the kernel's read rate against the block gather's
    for name in args.cases.split(","):
        case = CASES[name]
        results[name] = measure(case, args.reps, args.layers, against, dtype)
        tiles = get_tuning("cpu", case.head_dim, case.heads // case.kv_heads, dtype)
        print(
            f"{name}: {describe(case, dtype)}; tiles block_m={tiles.block_m} "
            f"block_n={tiles.block_n}",
            flush=True,
        )
        print(table({name: results[name]}), flush=True)
        if GATHER in results[name]:
            mb = kv_bytes(case, dtype) / 1e6
            kernel, floor = results[name]["cpu kernel"][1], results[name][GATHER][1]
            reads.append(
                f"{name}: the kernel reads its {mb:.1f} MB of K/V at {mb / kernel:.1f} GB/s, "
                f"the block gather at {mb / floor:.1f} GB/s ({floor / kernel:.0%})"
            )
            print(reads[-1], flush=True)
    text = "\n\n".join([table(results), *reads])
    header = f"{machine()}; {cpu_flags()}; {load_average()}"
    if args.against:
        commit = subprocess.run(
            ["git", "-C", str(args.against), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        header += f"; against {commit or args.against}, {args.layers} caches in turn"
    print(header)
    if args.out:
        args.out.write_text(header + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()

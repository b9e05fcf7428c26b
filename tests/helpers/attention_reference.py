"""Plain reference attention (softmax(QK^T)V with explicit masks) and random varlen cases.

Written independently of pagedllm.attention so that it can judge every backend.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Case:
    q_lens: list[int]
    k_lens: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    window: tuple[int, int]


def reference(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    scale: float,
    causal: bool,
    window: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """q[i] [n, H, D], k[i] / v[i] [L, Hk, D] -> out [sum n, H, D] fp32, lse [H, sum n]."""
    outs, lses = [], []
    for qi, ki, vi in zip(q, k, v):
        n, heads, _ = qi.shape
        length, kv_heads, _ = ki.shape
        rep = heads // kv_heads
        kf = ki.double().repeat_interleave(rep, dim=1)
        vf = vi.double().repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qi.double(), kf) * scale
        allowed = torch.ones(n, length, dtype=torch.bool)
        for row in range(n):
            pos = row + length - n  # bottom-right alignment
            for col in range(length):
                left, right = window[0], 0 if causal else window[1]
                if left >= 0 and col < pos - left:
                    allowed[row, col] = False
                if right >= 0 and col > pos + right:
                    allowed[row, col] = False
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: 0
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vf).float())
        lses.append(torch.where(lse.isinf(), float("inf"), lse).float())
    return torch.cat(outs), torch.cat(lses, dim=1)


def random_case(
    rng: random.Random,
    dtypes: tuple[torch.dtype, ...],
    head_dims: tuple[int, ...],
    max_len: int = 40,
) -> Case:
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 3, 4])
    batch = rng.randint(1, 4)
    q_lens, k_lens = [], []
    for _ in range(batch):
        k_len = rng.randint(1, max_len)
        q_lens.append(rng.choice([1, k_len, rng.randint(1, k_len)]))
        k_lens.append(k_len)
    causal = rng.random() < 0.7
    window = rng.choice([(-1, -1), (-1, -1), (rng.randint(0, 9), -1), (rng.randint(0, 9), 3)])
    return Case(
        q_lens, k_lens, heads, kv_heads, rng.choice(head_dims), rng.choice(dtypes), causal, window
    )


def make_tensors(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(n, case.heads, case.head_dim, generator=g) for n in case.q_lens]
    k = [torch.randn(n, case.kv_heads, case.head_dim, generator=g) for n in case.k_lens]
    v = [torch.randn(n, case.kv_heads, case.head_dim, generator=g) for n in case.k_lens]
    return [[t.to(case.dtype) for t in ts] for ts in (q, k, v)]


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def paginate(
    seqs: list[torch.Tensor],
    block_size: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter sequences into a paged cache with shuffled block ids; unused slots hold NaN-free
    noise. Returns (cache [num_blocks, block_size, Hk, D], block_table [B, max_blocks] int32)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-len(s) // block_size) for s in seqs]
    total = sum(need) + 3  # spare blocks that nobody owns
    ids = torch.randperm(total, generator=g).tolist()
    cache = torch.randn(total, block_size, *seqs[0].shape[1:], generator=g).to(seqs[0].dtype)
    table = torch.zeros(len(seqs), max(need) + 1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        for b in range(need[i]):
            block = ids.pop()
            table[i, b] = block
            chunk = seq[b * block_size : (b + 1) * block_size]
            cache[block, : len(chunk)] = chunk
    return cache, table


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU runs the C++ kernel's bf16 path on vdpbf16ps (AVX512-BF16 and friends)."""
    flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= set(flags)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX-BF16 tiles (the kernel's many-row products use them where
    Linux also grants the process the tile state)."""
    flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    return cpu_has_bf16_dot() and {"amx_tile", "amx_bf16"} <= set(flags)

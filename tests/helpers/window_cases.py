"""A paged attention case whose block-table entries before the sliding window name a
poisoned block (as the block manager points released blocks at its null block)."""

from __future__ import annotations

import torch

from helpers.attention_reference import cu_seqlens, paginate, reference
from pagedllm.attention.metadata import VarlenBatch

BLOCK = 4
WINDOW_LEFT = 7
Q_LENS = [1, 6, 1, 3]  # decode, a chunk, decode, a chunk
K_LENS = [41, 37, 9, 30]


def windowed_case(poison: float, dtype: torch.dtype = torch.float32):
    """q, k, v per sequence, and a paged cache whose table entries before each sequence's
    window (wholly before its first query's oldest visible key) name a poisoned block."""
    g = torch.Generator().manual_seed(3)
    q = [torch.randn(n, 4, 16, generator=g).to(dtype) for n in Q_LENS]
    k = [torch.randn(n, 2, 16, generator=g).to(dtype) for n in K_LENS]
    v = [torch.randn(n, 2, 16, generator=g).to(dtype) for n in K_LENS]
    key, table = paginate(k, BLOCK, 5)
    value, _ = paginate(v, BLOCK, 5)
    null = key.shape[0]
    key = torch.cat([key, torch.full_like(key[:1], poison)])
    value = torch.cat([value, torch.full_like(value[:1], poison)])
    nulled = 0
    for i, (n, length) in enumerate(zip(Q_LENS, K_LENS)):
        first_live = max(0, length - n - WINDOW_LEFT) // BLOCK
        table[i, :first_live] = null
        nulled += first_live
    assert nulled >= 10  # the case does test something
    batch = VarlenBatch(
        cu_seqlens_q=cu_seqlens(Q_LENS),
        seq_lens_k=torch.tensor(K_LENS, dtype=torch.int32),
        cu_seqlens_k=None,
        block_table=table,
        max_seqlen_q=max(Q_LENS),
        max_seqlen_k=max(K_LENS),
    )
    want, _ = reference(q, k, v, 16**-0.5, True, (WINDOW_LEFT, -1))
    return torch.cat(q), key, value, batch, want

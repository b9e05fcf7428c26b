"""A random attention case (helpers.attention_reference) as a kernel's inputs: the flat queries,
the K/V flat or paged through shuffled blocks, and the VarlenBatch that describes them."""

from __future__ import annotations

import torch

from helpers.attention_reference import Case, cu_seqlens, make_tensors, paginate
from pagedllm.attention.metadata import VarlenBatch


def case_inputs(case: Case, seed: int, block_size: int | None, launch_keys: int | None = None):
    """((q, k, v) per sequence, key, value, batch); launch_keys: the longest context the
    launch is sized for (default: the batch's own)."""
    q, k, v = make_tensors(case, seed)
    batch = VarlenBatch(
        cu_seqlens(case.q_lens),
        torch.tensor(case.k_lens, dtype=torch.int32),
        cu_seqlens(case.k_lens),
        None,
        max(case.q_lens),
        launch_keys or max(case.k_lens),
    )
    key, value = torch.cat(k), torch.cat(v)
    if block_size is not None:
        key, batch.block_table = paginate(k, block_size, seed)
        value, _ = paginate(v, block_size, seed)
        batch.cu_seqlens_k = None
    return (q, k, v), key, value, batch

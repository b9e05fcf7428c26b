"""Paged attention with a sliding window never needs the blocks before the window: the block
manager points their entries at a null block. Here that block is poisoned with NaN, so a
kernel that read it (even under a mask: 0 * NaN) would fail against the reference."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable
from helpers.window_cases import K_LENS, Q_LENS, WINDOW_LEFT, windowed_case

from pagedllm.attention import cpu_kernels
from pagedllm.attention.api import attention_varlen


def test_cpu_kernel_never_reads_blocks_before_the_window():
    if not cpu_kernels.load():
        unavailable("the C++ attention kernel did not build (no C++ toolchain?)")
    q, key, value, batch, want = windowed_case(float("nan"))
    out, _ = attention_varlen(q, key, value, batch, 16**-0.5, (WINDOW_LEFT, 0), impl="cpu")
    torch.testing.assert_close(out.float(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("poison", [0.0, 1e4])
def test_torch_reference_masks_the_null_block(poison):
    """The torch paths gather whole blocks and mask: a finite null block (the engine's is
    zeroed and never written) does not change the result."""
    q, key, value, batch, want = windowed_case(poison)
    out, _ = attention_varlen(q, key, value, batch, 16**-0.5, (WINDOW_LEFT, 0), impl="torch")
    torch.testing.assert_close(out.float(), want, atol=2e-5, rtol=2e-5)


def test_torch_backend_decode_masks_the_null_block():
    from pagedllm.attention.torch_backend import decode_attention

    q, key, value, batch, want = windowed_case(1e4)
    rows = [i for i, n in enumerate(Q_LENS) if n == 1]
    starts = batch.cu_seqlens_q[rows].long()
    out = decode_attention(
        q[starts],
        key,
        value,
        batch.block_table[rows],
        batch.seq_lens_k[rows],
        max(K_LENS[i] for i in rows),
        16**-0.5,
        WINDOW_LEFT,
    )
    ends = torch.tensor(Q_LENS).cumsum(0)[rows] - 1
    torch.testing.assert_close(out, want[ends], atol=2e-5, rtol=2e-5)

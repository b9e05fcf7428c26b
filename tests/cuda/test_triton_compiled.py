"""The compiled Triton kernel on a CUDA GPU against the plain reference (skipped without one):
varlen and paged batches, GQA, windows, and split-K decode over long contexts with the
device's own number of multiprocessors."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers.attention_reference import random_case, reference
from helpers.varlen_cases import case_inputs

from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import get_tuning

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def kernels():
    from pagedllm.attention import triton_kernels

    return triton_kernels


def run(kernels, case, seed: int, block_size: int | None, **tiles: int) -> int:
    """Check one case on the GPU; returns the number of key splits the kernel used."""
    (q, k, v), key, value, batch = case_inputs(case, seed, block_size)
    dev = torch.device("cuda")
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(VarlenBatch)}
    batch = dataclasses.replace(
        batch, **{k: t.to(dev) for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    )
    tuning = get_tuning(dev, case.head_dim, case.heads // case.kv_heads, case.dtype, **tiles)
    programs = len(case.q_lens) * case.kv_heads
    splits = kernels._num_splits(batch, programs, tuning) if max(case.q_lens) == 1 else 1
    scale = case.head_dim**-0.5
    window = (case.window[0], 0 if case.causal else case.window[1])
    out, lse = kernels.varlen_attention(
        torch.cat(q).to(dev), key.to(dev), value.to(dev), batch, scale, *window,
        return_lse=True, tuning=tuning,
    )  # fmt: skip
    want, want_lse = reference(q, k, v, scale, case.causal, case.window)
    tol = TOL[case.dtype]
    torch.testing.assert_close(out.float().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-3, rtol=1e-3)
    return splits


@pytest.mark.parametrize("seed", range(8))
def test_varlen_on_gpu_matches_reference(kernels, seed):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    case = random_case(random.Random(seed), dtypes, (64, 128), 200)
    run(kernels, case, seed, None)


@pytest.mark.parametrize("seed", range(8))
def test_paged_on_gpu_matches_reference(kernels, seed):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    case = random_case(random.Random(100 + seed), dtypes, (64, 128), 200)
    run(kernels, case, seed, block_size=random.Random(seed).choice([1, 16, 32]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_decode_splits_keys_on_gpu(kernels, dtype):
    """Two decoding sequences of 3,000 and 1,100 keys, GQA 4: too few programs for the GPU,
    so the keys are split and merged; with and without a window."""
    case = random_case(random.Random(7), (dtype,), (128,))
    case.q_lens, case.k_lens, case.heads, case.kv_heads = [1, 1], [3000, 1100], 8, 2
    case.causal, case.window = True, (-1, -1)
    assert run(kernels, case, 3, 16) > 1
    case.window = (700, -1)
    assert run(kernels, case, 3, 16) > 1

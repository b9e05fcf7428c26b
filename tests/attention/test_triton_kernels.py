"""The Triton kernel in Triton's CPU interpreter (TRITON_INTERPRET=1) on small shapes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers.attention_reference import random_case, reference
from helpers.ci import unavailable, under_ci
from helpers.triton_interpret import UNAVAILABLE, interpreted
from helpers.varlen_cases import case_inputs

from pagedllm.attention.tuning import get_tuning

if UNAVAILABLE is not None and not under_ci():  # under CI=true the kernels fixture fails
    pytest.skip(UNAVAILABLE, allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}
MODULES = ("pagedllm.attention.triton_kernels", "pagedllm.attention.triton_backend")


@pytest.fixture(scope="module")
def kernels():
    if UNAVAILABLE is not None:
        unavailable(UNAVAILABLE)
    with interpreted(*MODULES) as module:  # while the tests run: launches read the variable
        yield module


def run(
    kernels,
    case,
    seed: int,
    block_size: int | None,
    units: int = 1,
    launch_keys: int | None = None,
    **tiles: int,
):
    """launch_keys: the longest context the launch is sized for (default: the batch's)."""
    (q, k, v), key, value, batch = case_inputs(case, seed, block_size, launch_keys)
    tuning = get_tuning("cpu", case.head_dim, 1, case.dtype, **tiles)
    tuning = dataclasses.replace(tuning, caches=dataclasses.replace(tuning.caches, num_units=units))
    scale = case.head_dim**-0.5
    window = (case.window[0], 0 if case.causal else case.window[1])
    out, lse = kernels.varlen_attention(
        torch.cat(q), key, value, batch, scale, *window, return_lse=True, tuning=tuning
    )
    want, want_lse = reference(q, k, v, scale, case.causal, case.window)
    torch.testing.assert_close(out.float(), want, atol=TOL[case.dtype], rtol=TOL[case.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


TILES = dict(block_m=16, block_n=16, num_stages=2, split_keys=0)


@pytest.mark.parametrize("seed", range(4))
def test_varlen(kernels, seed):
    case = random_case(random.Random(seed), (torch.float32, torch.bfloat16), (16, 24), 24)
    run(kernels, case, seed, None, **TILES)


@pytest.mark.parametrize("seed", range(4))
def test_paged(kernels, seed):
    case = random_case(random.Random(50 + seed), (torch.float32, torch.float16), (16, 32), 24)
    run(kernels, case, seed, block_size=random.Random(seed).choice([1, 4, 16]), **TILES)


def test_split_k_decode(kernels, monkeypatch):
    """Long decode contexts split into key chunks whose partial results are merged."""
    merges = []
    merge = kernels._merge_splits
    monkeypatch.setattr(
        kernels, "_merge_splits", lambda o, lse, *a: merges.append(o.shape[0]) or merge(o, lse, *a)
    )
    case = random_case(random.Random(9), (torch.float32,), (16,))
    case.q_lens, case.k_lens, case.heads, case.kv_heads = [1, 1], [70, 37], 4, 2
    case.causal, case.window = True, (-1, -1)
    # 4 programs (2 sequences x 2 KV heads) on a device of 64 units: split into 16-key chunks.
    run(kernels, case, 2, 4, units=64, **{**TILES, "split_keys": 16})
    case.window = (20, -1)  # a window: early splits see nothing for some rows
    run(kernels, case, 2, 4, units=64, **{**TILES, "split_keys": 16})
    assert merges == [5, 5]  # ceil(70 / 16) chunks


def test_split_k_launch_sized_for_a_longer_context(kernels, monkeypatch):
    """A launch sized for 1,000 keys (as a CUDA graph's is, for max_model_len) over
    sequences of 70 and 37 keys: 8 splits, each sequence's own keys spread over them."""
    busy = []  # per merge: how many splits saw keys, for each token (its first head)
    merge = kernels._merge_splits
    monkeypatch.setattr(
        kernels,
        "_merge_splits",
        lambda o, lse, *a: busy.append(lse[:, 0].isfinite().sum(0).tolist()) or merge(o, lse, *a),
    )
    case = random_case(random.Random(9), (torch.float32,), (16,))
    case.q_lens, case.k_lens, case.heads, case.kv_heads = [1, 1], [70, 37], 4, 2
    case.causal, case.window = True, (-1, -1)
    # 4 programs on 16 units: want 8 splits (2 x 16 / 4), fewer than ceil(1000 / 16)
    run(kernels, case, 2, 4, units=16, launch_keys=1000, **{**TILES, "split_keys": 16})
    assert busy == [[5, 3]]  # 16-key chunks: ceil(70 / 16) and ceil(37 / 16) of the 8


def test_engine_greedy_matches_hf_with_triton_backend(kernels, model_factory):
    """The whole engine on the "triton" backend (interpreted): same tokens as transformers."""
    from helpers.oracle import hf_greedy

    from pagedllm import LLM, SamplingParams

    model_dir = model_factory("mistral")  # sliding window 24
    prompts = [list(range(3, 33)), list(range(40, 45))]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(model_dir, prompts, 4)


def test_paged_window_never_reads_blocks_before_it(kernels):
    """Entries before a sequence's window name a NaN block (the block manager's null block
    for released blocks): the kernel's key range starts at the window, so it never loads it."""
    from helpers.window_cases import WINDOW_LEFT, windowed_case

    q, key, value, batch, want = windowed_case(float("nan"))
    tuning = get_tuning("cpu", 16, 1, torch.float32, **TILES)
    out, _ = kernels.varlen_attention(
        q, key, value, batch, 16**-0.5, WINDOW_LEFT, 0, return_lse=True, tuning=tuning
    )
    torch.testing.assert_close(out.float(), want, atol=1e-4, rtol=1e-4)

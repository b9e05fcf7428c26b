"""The flash-attn compatible functions: shapes, arguments, errors, training use."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_reference import cu_seqlens, paginate, reference

from pagedllm.attention import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def split(t: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, lens))


def test_varlen_gqa_window_matches_reference():
    lens_q, lens_k = [5, 1, 12], [9, 20, 12]
    q, k, v = rand(18, 6, 32), rand(41, 2, 32, seed=1), rand(41, 2, 32, seed=2)
    out, lse, probs = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens(lens_q),
        cu_seqlens(lens_k),
        12,
        20,
        causal=True,
        window_size=(4, -1),
        return_attn_probs=True,
    )
    want, want_lse = reference(
        split(q, lens_q), split(k, lens_k), split(v, lens_k), 32**-0.5, True, (4, -1)
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    assert lse.shape == (6, 18) and probs is None


def test_paged_call_with_block_table_and_seqused_k():
    lens_q, lens_k = [3, 1], [11, 6]
    q = rand(4, 4, 16, dtype=torch.bfloat16)
    k_seqs = [rand(n, 2, 16, dtype=torch.bfloat16, seed=n) for n in lens_k]
    v_seqs = [rand(n, 2, 16, dtype=torch.bfloat16, seed=n + 50) for n in lens_k]
    k_cache, table = paginate(k_seqs, 4, seed=3)
    v_cache, _ = paginate(v_seqs, 4, seed=3)
    kwargs = dict(max_seqlen_q=3, max_seqlen_k=11, causal=True, block_table=table)
    by_cu = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(lens_q), cu_seqlens(lens_k), **kwargs
    )
    by_used = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens(lens_q),
        None,
        seqused_k=torch.tensor(lens_k, dtype=torch.int32),
        **kwargs,
    )
    want, _ = reference(split(q, lens_q), k_seqs, v_seqs, 0.25, True, (-1, -1))
    torch.testing.assert_close(by_cu.float(), want, atol=3e-2, rtol=3e-2)
    assert torch.equal(by_cu, by_used)


def test_batched_and_packed_variants_agree():
    q, k, v = rand(2, 7, 4, 16), rand(2, 9, 2, 16, seed=1), rand(2, 9, 2, 16, seed=2)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want, want_lse = reference(list(q), list(k), list(v), 0.25, True, (-1, -1))
    torch.testing.assert_close(out, want.view(2, 7, 4, 16), atol=2e-5, rtol=2e-5)
    assert lse.shape == (2, 4, 7)  # flash-attn's [batch, heads, seqlen_q]
    torch.testing.assert_close(lse, want_lse.view(4, 2, 7).transpose(0, 1))
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, causal=True), out)
    cu_q, cu_k = cu_seqlens([7, 7]), cu_seqlens([9, 9])
    packed = flash_attn_varlen_kvpacked_func(
        q.flatten(0, 1), kv.flatten(0, 1), cu_q, cu_k, 7, 9, causal=True
    )
    torch.testing.assert_close(packed, out.flatten(0, 1))
    qkv = torch.stack([q, q, q], dim=2)  # self-attention, same heads for q and k/v
    self_out = flash_attn_qkvpacked_func(qkv, softmax_scale=0.1)
    torch.testing.assert_close(self_out, flash_attn_func(q, q, q, softmax_scale=0.1))
    var = flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu_q, 7, 0.0, 0.1)
    torch.testing.assert_close(var, self_out.flatten(0, 1))


def test_alibi_and_softcap_match_reference():
    q, k, v = rand(1, 6, 2, 16), rand(1, 10, 2, 16, seed=1), rand(1, 10, 2, 16, seed=2)
    slopes = torch.tensor([0.5, 0.25])
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, softcap=2.0)
    scores = torch.einsum("qhd,khd->hqk", q[0].double(), k[0].double()) * 0.25
    scores = 2.0 * torch.tanh(scores / 2.0)
    pos = torch.arange(4, 10)[:, None]
    keys = torch.arange(10)[None, :]
    scores = scores - slopes.double()[:, None, None] * (pos - keys).abs()
    scores = scores.masked_fill(keys > pos, float("-inf"))
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v[0].double())
    torch.testing.assert_close(out[0], want.float(), atol=2e-5, rtol=2e-5)


def test_gradients_flow_as_in_training():
    q = rand(2, 5, 4, 16).requires_grad_()
    k = rand(2, 5, 2, 16, seed=1).requires_grad_()
    v = rand(2, 5, 2, 16, seed=2).requires_grad_()
    flash_attn_func(q, k, v, causal=True).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want, _ = reference(list(q), list(k), list(v), 0.25, True, (-1, -1))  # double, autograd
    want.square().sum().backward()
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=1e-4, rtol=1e-4)


def test_dropout_drops_and_rescales():
    q, k, v = rand(1, 4, 2, 16), rand(1, 8, 2, 16, seed=1), torch.ones(1, 8, 2, 16)
    plain = flash_attn_func(q, k, v)
    torch.manual_seed(0)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.allclose(a, plain)
    # v = 1: each output is the sum of the kept probabilities / (1 - p), 1 on average.
    torch.manual_seed(1)
    mean = torch.stack([flash_attn_func(q, k, v, dropout_p=0.5) for _ in range(300)]).mean()
    assert abs(mean.item() - 1.0) < 0.05


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=rand(4, 16)), "q must be"),
        (dict(k=rand(10, 3, 16), v=rand(10, 3, 16)), "multiple of num_kv_heads"),
        (dict(v=rand(10, 2, 8)), "k and v must both be"),
        (dict(q=rand(4, 4, 16).to(torch.int32)), "dtype"),
        (dict(k=rand(10, 2, 16, dtype=torch.float16)), "dtype"),
        (dict(cu_q=torch.tensor([0, 4])), "int32"),
        (dict(cu_k=torch.tensor([0, 4, 10], dtype=torch.int32)), "sequences"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(window_size=(1, 2, 3)), "window_size"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    args = dict(
        q=rand(4, 4, 16),
        k=rand(10, 2, 16),
        v=rand(10, 2, 16),
        cu_q=cu_seqlens([4]),
        cu_k=cu_seqlens([10]),
    )
    args.update(change)
    q, k, v, cu_q, cu_k = (args.pop(n) for n in ("q", "k", "v", "cu_q", "cu_k"))
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 10, **args)

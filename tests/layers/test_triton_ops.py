"""The Triton kernels of the ops' forward_cuda (layers/triton_ops.py) in Triton's CPU
interpreter, against the ops' forward_native on the same inputs: residual + RMSNorm (Llama's
and Gemma's forms), silu(gate) * up, NeoX rotary over strided q / k views."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable, under_ci
from helpers.triton_interpret import UNAVAILABLE, interpreted

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.custom_op import OpTarget, build_target
from pagedllm.layers.norm import PlainRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

if UNAVAILABLE is not None and not under_ci():  # under CI=true the ops fixture fails
    pytest.skip(UNAVAILABLE, allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    if UNAVAILABLE is not None:
        unavailable(UNAVAILABLE)
    with interpreted("pagedllm.layers.triton_ops") as module:
        yield module


def close(got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> None:
    """float32: equal where the kernel rounds where torch does (exact), else up to the order
    of a sum. bfloat16: the interpreter rounds float32 to bfloat16 by truncation where the GPU
    (and torch) round to nearest even, so within two such roundings; tests/cuda compares
    bfloat16 bit for bit on a GPU."""
    tol = (0.0 if exact else 1e-5) if want.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def native(op_cls, *args, **kwargs):
    with build_target(OpTarget("cpu", cpu_fused_ops=False)):
        op = op_cls(*args, **kwargs)
    assert op.impl == "native"
    return op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_matches_native(ops, dtype, offset):
    g = torch.Generator().manual_seed(0)
    norm = native(RMSNorm, 48, 1e-5, dtype, offset=offset)
    norm.weight.copy_(torch.randn(48, generator=g))
    wide = torch.randn(5, 64, generator=g).to(dtype)
    x = wide[:, :48]  # rows 64 apart: the kernel reads each row through its stride
    residual = torch.randn(5, 48, generator=g).to(dtype)
    with torch.inference_mode():
        want_out, want_sum = norm(x, residual)
        got_out, got_sum = ops.add_rms_norm(x, residual, norm.weight, 1e-5, offset)
        close(got_sum, want_sum, exact=True)
        close(got_out, want_out)
        alone_out, alone_sum = ops.add_rms_norm(x, None, norm.weight, 1e-5, offset)
        assert alone_sum is x  # no residual: x itself starts it, as forward_native returns
        close(alone_out, norm(x)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_matches_native(ops, dtype):
    """Qwen3's q / k norms: [T, heads, head_dim] views with token strides of the qkv row."""
    g = torch.Generator().manual_seed(1)
    norm = native(PlainRMSNorm, 16, 1e-6, dtype)
    norm.weight.copy_(torch.randn(16, generator=g))
    qkv = torch.randn(3, 4 * 16 + 32, generator=g).to(dtype)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    rows = q.reshape(-1, 16)
    got, _ = ops.add_rms_norm(rows, None, norm.weight, 1e-6, False)
    close(got.view(q.shape), norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_native(ops, dtype):
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    close(ops.silu_and_mul(x), native(SiluAndMul, dtype)(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_neox_matches_native(ops, dtype):
    """q and k as views of one qkv row per token (the attention's split), random positions;
    every product and sum rounded where the torch ops round."""
    rope = native(RotaryEmbedding, 16, 64, 10000.0, None, dtype)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(dtype)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    k = qkv[:, 4 * 16 : 6 * 16].view(5, 2, 16)
    positions = torch.randint(0, 64, (5,), generator=g)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = ops.rotary_neox(positions, q, k, rope.cos, rope.sin)
    close(got_q, want_q, exact=True)
    close(got_k, want_k, exact=True)

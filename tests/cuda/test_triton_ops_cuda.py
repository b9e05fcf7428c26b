"""The Triton ops of forward_cuda (layers/triton_ops.py) compiled on a CUDA GPU against the
torch ops they replace, bfloat16 included (the interpreter cannot round bfloat16 as the GPU
does); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.custom_op import OpTarget, build_target
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # a sum's order; one bf16 rounding


def both(op_cls, *args, **kwargs):
    """The op built for CUDA with the Triton kernels and with the torch ops."""
    ops = []
    for fused in (True, False):
        with build_target(OpTarget("cuda", cuda_fused_ops=fused)), torch.device("cuda"):
            ops.append(op_cls(*args, **kwargs))
    assert [op.impl for op in ops] == ["cuda", "native"]
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_on_gpu_matches_torch_ops(dtype, offset):
    fused, plain = both(RMSNorm, 576, 1e-5, dtype, offset=offset)
    weight = torch.randn(576, device="cuda").to(dtype)
    fused.weight.copy_(weight)
    plain.weight.copy_(weight)
    x = torch.randn(37, 576, device="cuda").to(dtype)
    residual = torch.randn(37, 576, device="cuda").to(dtype)
    with torch.inference_mode():
        out, summed = fused(x, residual)
        want_out, want_sum = plain(x, residual)
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_gpu_matches_torch_ops(dtype):
    fused, plain = both(SiluAndMul, dtype)
    x = torch.randn(37, 2 * 1536, device="cuda").to(dtype) * 4
    torch.testing.assert_close(fused(x), plain(x), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_gpu_equals_torch_ops(dtype):
    fused, plain = both(RotaryEmbedding, 64, 2048, 10000.0, None, dtype)
    qkv = torch.randn(37, (9 + 3 + 3) * 64, device="cuda").to(dtype)
    q = qkv[:, : 9 * 64].view(37, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    positions = torch.randint(0, 2048, (37,), device="cuda")
    got, want = fused(positions, q, k), plain(positions, q, k)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)

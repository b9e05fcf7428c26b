"""The C++ fused residual + RMSNorm and rotary kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable

from pagedllm.layers import cpu_fused
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_fused.load():
        unavailable("the C++ fused ops could not be built")


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_add_rms_norm_matches_torch(monkeypatch, dtype, rows) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(40, 1e-6, dtype)
    norm.weight.copy_(torch.randn(40))
    x, residual = torch.randn(rows, 40, dtype=dtype), torch.randn(rows, 40, dtype=dtype)
    with torch.inference_mode():
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "0")
        want_out, want_res = norm(x.clone(), residual.clone())
        want_first, want_first_res = norm(x.clone())
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "1")
        calls = []
        monkeypatch.setattr(cpu_fused, "fused_add_rms_norm", _counted(calls, cpu_fused))
        x_in = x.clone()
        got_out, got_res = norm(x_in, residual.clone())
        got_first, got_first_res = norm(x)
    assert len(calls) == 2  # the kernel ran, both with and without a residual
    torch.testing.assert_close(got_res, want_res, **_tol(dtype))
    torch.testing.assert_close(got_out, want_out, **_tol(dtype))
    torch.testing.assert_close(got_first, want_first, **_tol(dtype))
    assert torch.equal(got_first_res, want_first_res) and got_first_res is not x
    assert got_out.data_ptr() == x_in.data_ptr()  # in place: no new tensor per layer


def _counted(calls: list, module) -> object:
    real = module.fused_add_rms_norm

    def wrapper(*args):
        calls.append(1)
        return real(*args)

    return wrapper


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_torch_on_strided_qkv(monkeypatch, dtype) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 64, 10000.0, None, dtype)
    qkv = torch.randn(5, (4 + 2 * 2) * 32, dtype=dtype)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k = q.view(5, 4, 32), k.view(5, 2, 32)  # strided rows, as in the attention layer
    positions = torch.tensor([0, 1, 7, 63, 30])
    with torch.inference_mode():
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "0")
        want_q, want_k = rope(positions, q, k)
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "1")
        got_q, got_k = rope(positions, q, k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    if dtype == torch.float32:  # same roundings, no FMA: equal to the bit
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))


def test_rotary_rejects_positions_outside_the_table() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0, None, torch.float32)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="rotary table"):
        cpu_fused.rotary_neox(torch.tensor([8]), q, k, rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(monkeypatch, dtype) -> None:
    from pagedllm.layers.activation import SiluAndMul

    torch.manual_seed(0)
    x = torch.randn(6, 2 * 40, dtype=dtype) * 8  # wide enough to reach exp's far range
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    with torch.inference_mode():
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "0")
        want = SiluAndMul()(x)
        monkeypatch.setenv("PAGEDLLM_CPU_FUSED_OPS", "1")
        calls = []
        real = cpu_fused.silu_and_mul
        monkeypatch.setattr(cpu_fused, "silu_and_mul", lambda t: calls.append(1) or real(t))
        got = SiluAndMul()(x)
    assert calls == [1]
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else _tol(dtype)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_torch(dtype, rows, bias) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 200, dtype=dtype), torch.randn(70, 200, dtype=dtype)
    b = torch.randn(70, dtype=dtype) if bias else None
    got = cpu_fused.gemv(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, 70)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)


def test_linear_layer_takes_the_gemv_at_one_row_only(monkeypatch) -> None:
    from pagedllm.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(48, 32, bias=True)
    layer.weight.copy_(torch.randn(32, 48))
    layer.bias.copy_(torch.randn(32))
    calls = []
    real = cpu_fused.gemv
    monkeypatch.setattr(cpu_fused, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(
                layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
            )
    assert calls == [1]

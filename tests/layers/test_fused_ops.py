"""The C++ fused ops (residual + RMSNorm, plain and offset; RMSNorm alone; rotary; SiLU and
GELU(tanh) gating; GEMV) against the torch ops they replace, and the choice of an op's
implementation, made once when it is built."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable

from pagedllm.layers import cpu_fused
from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.custom_op import OpTarget, build_target
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.norm import PlainRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_fused.load():
        unavailable("the C++ fused ops could not be built")


def native(make):  # noqa: ANN001, ANN201
    """The op ``make()`` builds, with the torch implementation (fused ops off)."""
    with build_target(OpTarget("cpu", cpu_fused_ops=False)):
        op = make()
    assert op.impl == "native"
    return op


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm_matches_torch(monkeypatch, dtype, rows, offset) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(40, 1e-6, dtype, offset)
    assert norm.impl == "cpu"
    norm.weight.copy_(torch.randn(40))
    reference = native(lambda: RMSNorm(40, 1e-6, dtype, offset))
    reference.weight.copy_(norm.weight)
    x, residual = torch.randn(rows, 40, dtype=dtype), torch.randn(rows, 40, dtype=dtype)
    with torch.inference_mode():
        want_out, want_res = reference(x.clone(), residual.clone())
        want_first, want_first_res = reference(x.clone())
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


def _norm_of_sums(sums: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool):  # noqa: ANN202
    """The kernel's bf16 RMSNorm of rows, op by op in fp32 (no FMA): 16 lanes of squares, the
    rest into lane 0, the lanes summed in order, each rounding to bf16 where the loop rounds."""
    f = sums.float()
    dim, whole = f.shape[1], f.shape[1] // 16 * 16
    lanes = torch.zeros(f.shape[0], 16)
    for i in range(0, whole, 16):
        lanes = lanes + f[:, i : i + 16] * f[:, i : i + 16]
    for i in range(whole, dim):
        lanes[:, 0] = lanes[:, 0] + f[:, i] * f[:, i]
    total = torch.zeros(f.shape[0])
    for j in range(16):
        total = total + lanes[:, j]
    inv = (1.0 / torch.sqrt(total / dim + eps))[:, None]
    if offset:
        return ((f * inv) * (1.0 + weight.float())).bfloat16()
    return (weight.float() * (f * inv).bfloat16().float()).bfloat16()


@pytest.mark.parametrize("dim", [7, 40, 576])  # the scalar loop alone; 8 or 16 lanes and a rest
@pytest.mark.parametrize("offset", [False, True])
def test_bf16_norms_give_the_scalar_loops_bits(dim, offset) -> None:
    """bf16 norms run 16 lanes at a time where the build has AVX-512, 8 where it has AVX2:
    residual + x rounded to bf16, the squares' sums and the scaled rows come out as the scalar
    loop's bits."""
    torch.manual_seed(dim)
    x, residual = torch.randn(3, dim).bfloat16() * 3, torch.randn(3, dim).bfloat16()
    weight = torch.randn(dim).bfloat16()
    sums = (x.float() + residual.float()).bfloat16()
    with torch.inference_mode():
        out, res = cpu_fused.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6, offset)
        alone = cpu_fused.rms_norm(sums, weight, 1e-6, offset)
    want = _norm_of_sums(sums, weight, 1e-6, offset)
    assert torch.equal(res.view(torch.int16), sums.view(torch.int16))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(alone.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_plain_rms_norm_per_head_matches_torch(dtype, offset) -> None:
    """The per-head q / k norm on a strided view of a qkv projection, and a norm of rows."""
    torch.manual_seed(1)
    norm = PlainRMSNorm(32, 1e-6, dtype, offset)
    norm.weight.copy_(torch.randn(32))
    reference = native(lambda: PlainRMSNorm(32, 1e-6, dtype, offset))
    reference.weight.copy_(norm.weight)
    qkv = torch.randn(5, (4 + 2 * 2) * 32, dtype=dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # strided rows
    with torch.inference_mode():
        got, want = norm(q), reference(q)
        rows = torch.randn(3, 32, dtype=dtype)
        got_rows, want_rows = norm(rows), reference(rows)
    assert got.shape == (5, 4, 32) and got.is_contiguous()
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(got_rows, want_rows, **_tol(dtype))


def test_offset_norm_is_gemmas() -> None:
    """offset: x_normed * (1 + w) in float32, rounded once (Gemma 3's RMSNorm)."""
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    norm = PlainRMSNorm(16, 1e-6, torch.bfloat16, offset=True)
    norm.weight.copy_(w)
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), want.to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_ops_pick_their_implementation_when_built() -> None:
    assert RMSNorm(8, 1e-6, torch.float32).impl == "cpu"
    assert RMSNorm(8, 1e-6, torch.float16).impl == "native"  # no fp16 C++ kernel
    with build_target(OpTarget("cuda", cuda_fused_ops=True)):
        assert RMSNorm(8, 1e-6, torch.float32).impl == "cuda"
        assert SiluAndMul(torch.float32).impl == "cuda"
        assert GeluTanhAndMul(torch.float32).impl == "native"  # no Triton kernel
    with build_target(OpTarget("cuda")):  # the Triton ops are off unless asked for
        assert RMSNorm(8, 1e-6, torch.float32).impl == "native"
    with build_target(OpTarget("cpu", cpu_fused_ops=False)):
        assert GeluTanhAndMul(torch.float32).impl == "native"
        assert not ReplicatedLinear(8, 8).cpu_gemv


def _counted(calls: list, module) -> object:
    real = module.fused_add_rms_norm

    def wrapper(*args):
        calls.append(1)
        return real(*args)

    return wrapper


@pytest.mark.parametrize("dtype", DTYPES)
# bf16 halves of 16 features take AVX-512 vectors, of 8 AVX2 ones; 40 the scalar loop
@pytest.mark.parametrize("dim", [32, 48, 40])
def test_rotary_matches_torch_on_strided_qkv(dtype, dim) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(dim, 64, 10000.0, None, dtype)
    reference = native(lambda: RotaryEmbedding(dim, 64, 10000.0, None, dtype))
    qkv = torch.randn(5, (4 + 2 * 2) * dim, dtype=dtype)
    q, k, _ = qkv.split([4 * dim, 2 * dim, 2 * dim], dim=-1)
    q, k = q.view(5, 4, dim), k.view(5, 2, dim)  # strided rows, as in the attention layer
    positions = torch.tensor([0, 1, 7, 63, 30])
    with torch.inference_mode():
        want_q, want_k = reference(positions, q, k)
        got_q, got_k = rope(positions, q, k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    if dtype in (torch.float32, torch.bfloat16):  # same roundings, no FMA: equal to the bit
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))


def test_rotary_rejects_positions_outside_the_table() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0, None, torch.float32)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 1, 16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="rotary table"):
        cpu_fused.rotary_neox(torch.tensor([8]), q, k, rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("op", "kernel"), [(SiluAndMul, "silu_and_mul"), (GeluTanhAndMul, "gelu_tanh_and_mul")]
)
def test_gated_activations_match_torch(monkeypatch, dtype, op, kernel) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 2 * 40, dtype=dtype) * 8  # wide enough to reach exp's far range
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    with torch.inference_mode():
        want = native(lambda: op(dtype))(x)
        calls = []
        real = getattr(cpu_fused, kernel)
        monkeypatch.setattr(cpu_fused, kernel, lambda t: calls.append(1) or real(t))
        got = op(dtype)(x)
    assert calls == [1]
    # fp32: SiLU within 1e-6; tanh's last bits differ from ATen's vectorized tanh
    fp32 = 1e-6 if op is SiluAndMul else 1e-5
    tol = {"atol": fp32, "rtol": fp32} if dtype == torch.float32 else _tol(dtype)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_gives_the_same_bits_in_vector_lanes_and_the_scalar_loop(dtype) -> None:
    """bf16 rows of 16 or more features run 16 at a time where the build has AVX-512 (8 at a
    time where it has AVX2 only), fp32 rows 8 at a time where it has AVX2; a row of one feature
    runs the scalar loop. The same
    values (exp's clamped range, signed zeros, NaN, infinities, denormals) either way give the
    same bits."""
    torch.manual_seed(0)
    special = [-100.0, 100.0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), 87.0, -87.0,
               88.5, -1e-30, 1e-30, 3e38, -3e38, 0.5, -0.5, 2e-39, -2e-39]  # fmt: skip
    gate = torch.cat([torch.randn(2048 - len(special)) * 8, torch.tensor(special)]).to(dtype)
    up = torch.randn(gate.numel()).to(dtype)
    with torch.inference_mode():
        lanes = cpu_fused.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
        scalar = cpu_fused.silu_and_mul(torch.stack([gate, up], dim=1))[:, 0]
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(lanes.view(bits), scalar.view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [200, 208, 576])  # bf16 at one row on AVX2: 32s, a 16, the rest
@pytest.mark.parametrize("n", [70, 1500])  # one chunk of rows; chunks on every thread
def test_gemv_matches_torch(dtype, rows, bias, k, n) -> None:
    torch.manual_seed(rows)
    # x's rows apart in memory (a slice of wider rows): the kernel copies x by its row stride
    x = torch.randn(rows, k + 24, dtype=dtype)[:, :k]
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    got = cpu_fused.gemv(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)


def test_linear_layer_takes_the_gemv_at_one_row_only(monkeypatch) -> None:
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


@pytest.mark.parametrize("rows", [2, 5, 64, 65, 130])  # bf16 on AVX2: GEMV passes, widened slabs
@pytest.mark.parametrize("bias", [False, True])
def test_float_linear_is_f_linear_and_bf16_keeps_fp32_sums(rows, bias) -> None:
    """Past the GEMV's one row the layers take float_linear: fp32 is F.linear's product to the
    bit; bf16 is within its output's rounding of the fp32 product of the same values (on a
    build without AVX-512 it runs the bf16 GEMV four rows a pass up to 64 rows, beyond that a
    weight widened to fp32 in slabs, 1,820 rows of 576 features a slab: 3,000 rows take two)."""
    torch.manual_seed(rows)
    w, x = torch.randn(3000, 576), torch.randn(rows, 576)
    b = torch.randn(3000) if bias else None
    with torch.inference_mode():
        assert torch.equal(cpu_fused.float_linear(x, w, b), torch.nn.functional.linear(x, w, b))
        wb, xb = w.bfloat16(), x.bfloat16()
        bb = None if b is None else b.bfloat16()
        got = cpu_fused.float_linear(xb, wb, bb)
        want = torch.nn.functional.linear(
            xb.float(), wb.float(), None if bb is None else bb.float()
        )
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 3000)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)


def test_bf16_layer_takes_float_linear_past_one_row(monkeypatch) -> None:
    layer = ReplicatedLinear(48, 32, bias=False, dtype=torch.bfloat16)
    layer.weight.copy_(torch.randn(32, 48))
    calls = []
    real = cpu_fused.float_linear
    monkeypatch.setattr(
        cpu_fused, "float_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.inference_mode():
        for rows in (1, 7):
            layer(torch.randn(rows, 48, dtype=torch.bfloat16))
    assert calls == [7]


def test_argmax_matches_torch_on_ties_infinities_and_nan() -> None:
    """Greedy's pick: the first of equal maxima, a NaN row's first NaN, an all -inf row 0."""
    torch.manual_seed(0)
    rows = torch.randn(9, 1001)  # not a multiple of the 16 lanes
    rows[0, 5] = rows[0, 900] = 9.0  # a tie across lanes
    rows[1] = float("-inf")
    rows[2, 17] = rows[2, 3] = float("nan")
    rows[3, 1000] = 50.0  # in the tail
    rows[4] = 1.0  # all equal
    rows[5, 16] = rows[5, 32] = 7.0  # a tie within one lane
    for x in (rows, torch.randn(48, 49152), torch.randn(2, 7)):
        assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=-1))
    half = torch.randn(3, 40, dtype=torch.bfloat16)  # other dtypes: torch's own
    assert torch.equal(cpu_fused.argmax(half), half.argmax(dim=-1))

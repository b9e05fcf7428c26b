"""The C++ int8 GEMM for few rows against a float64 reference of the same arithmetic, on every
instruction set this CPU runs, and against the oneDNN kernel it stands in for."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
from helpers.ci import unavailable
from helpers.disassembly import kernel_bodies, loaded_library

from pagedllm.layers import cpu_int8
from pagedllm.layers.quantization import quantize_weight


@pytest.fixture(autouse=True)
def _built() -> None:
    if not cpu_int8.load():
        unavailable("the C++ int8 kernel did not build (no C++ toolchain?)")


def reference(x, q, scale, levels, bias=None):  # noqa: ANN001, ANN201
    """Per-row int8 activations, exact integer sums (float64), then the two scales."""
    step = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / levels
    xq = (x / step).round().clamp(-levels, levels)
    acc = (xq.double() @ q.double().t()).float()
    y = acc * scale * step
    return y if bias is None else y + bias


# The two refusals that leave an ISA out; any other error is a failure, not a smaller list.
NOT_RUNNABLE = ("this CPU does not run", "without VNNI, activations must keep")


def runnable_isas(levels: int) -> list[str]:
    isas = []
    for name in cpu_int8.ISAS:
        x, w = torch.randn(1, 8), torch.randint(-127, 128, (16, 8), dtype=torch.int8)
        packed, rowsum = cpu_int8.pack(w)
        try:
            cpu_int8.linear(x, packed, rowsum, torch.ones(16), levels, isa=name)
        except RuntimeError as e:
            if not any(reason in str(e) for reason in NOT_RUNNABLE):
                raise
            continue
        isas.append(name)
    assert "scalar" in isas  # runs everywhere
    return isas


@pytest.mark.parametrize("levels", [63, 127])
# (150, 48, 2048): more rows than one L2-sized chunk of x (128 at K = 2048)
@pytest.mark.parametrize(
    "m,n,k", [(1, 16, 4), (3, 37, 50), (5, 64, 130), (9, 130, 67), (150, 48, 2048)]
)
def test_matches_reference_on_every_isa(levels: int, m: int, n: int, k: int) -> None:
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k) * 3
    q, scale = quantize_weight(torch.randn(n, k))
    bias = torch.randn(n) if n % 2 else None
    packed, rowsum = cpu_int8.pack(q)
    assert torch.equal(rowsum, q.int().sum(dim=1, dtype=torch.int32))
    want = reference(x, q, scale, levels, bias)
    isas = runnable_isas(levels)
    assert "scalar" in isas
    for name in isas:
        got = cpu_int8.linear(x, packed, rowsum, scale, levels, bias, isa=name)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=name)


@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 21])
def test_avx2_rows_in_passes_of_four_equal_the_scalar_kernel_bit_for_bit(m: int) -> None:
    """AVX2 takes up to 4 rows of x a pass over a weight block (5-8 rows in two passes) and
    rescales whole blocks of 16 outputs on 8 lanes: the integer sums are exact and the
    rescale rounds as the scalar loop does, so the outputs are equal, with and without a bias
    and with a partial last block (40 outputs)."""
    if "avx2" not in runnable_isas(63):
        pytest.skip("this CPU has no AVX2")
    torch.manual_seed(m)
    for n, bias in ((64, None), (40, torch.randn(40))):
        x = torch.randn(m, 130) * 3
        q, scale = quantize_weight(torch.randn(n, 130))
        packed, rowsum = cpu_int8.pack(q)
        scalar = cpu_int8.linear(x, packed, rowsum, scale, 63, bias, isa="scalar")
        got = cpu_int8.linear(x, packed, rowsum, scale, 63, bias, isa="avx2")
        assert torch.equal(got, scalar), (m, n)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_one_and_two_row_avx2_kernels_request_their_weight_ahead_into_l2() -> None:
    """A decode step's one or two rows stream the weight: on AVX2 without VNNI rows_avx2<1>
    and <2> carry their request ahead (prefetcht1) in the built library, and the passes of
    more rows, which read each block from L1 for their second pass, carry none; so do the
    AVX-512 VNNI kernel's one and two rows. The products are the same bits with or without
    it, so only the machine code shows it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 and AVX-512 kernels are x86's")
    library = loaded_library("pagedllm_int8")
    kernels = [("rows_avx2", 1), ("rows_avx2", 2), ("rows_avx2", 3), ("rows_avx2", 4),
               ("block_avx512vnni", 1), ("block_avx512vnni", 2)]  # fmt: skip
    for kernel, rows in kernels:
        bodies = kernel_bodies(library, f"{kernel}<{rows}>")
        assert len(bodies) == 1, f"{kernel}<{rows}> is not its own function in {library}"
        assert ("prefetcht1" in next(iter(bodies.values()))) == (rows <= 2), (kernel, rows)


def test_activations_round_half_to_even_as_torch_does() -> None:
    """x's codes (the CPU's vector loops, 8 or 16 features at a time, and the scalar tail)
    are torch's: with an identity weight each output is a code times the row's step, and
    with a step of 1 every other x is a tie, which rounds to even."""
    torch.manual_seed(5)
    k, levels = 130, 63
    x = torch.randint(-126, 127, (3, k)).float() / 2  # halves: every odd one a tie
    x[:, 0] = levels  # absmax / levels = 1: the step
    x[1, 5] = -levels
    packed, rowsum = cpu_int8.pack(torch.eye(k, dtype=torch.int8))
    want = reference(x, torch.eye(k, dtype=torch.int8), torch.ones(k), levels)
    assert torch.equal(want, x.round())  # half to even
    for name in runnable_isas(levels):
        got = cpu_int8.linear(x, packed, rowsum, torch.ones(k), levels, isa=name)
        assert torch.equal(got, want), name


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(-127, 128, (37, 50), dtype=torch.int8)
    packed, _ = cpu_int8.pack(q)
    assert torch.equal(cpu_int8.unpack(packed, tuple(q.shape)), q)


def test_default_cpu_kernel_is_the_cpp_one_and_equals_onednn() -> None:
    """The default CPU kernel (per-token observer) is this one, with oneDNN's integers."""
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization import DynamicQuantConfig

    torch.manual_seed(1)
    weight, bias = torch.randn(40, 96), torch.randn(40)
    layers = []
    for kernel in (None, "onednn"):
        layer = ReplicatedLinear(96, 40, bias=True)
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias)
        DynamicQuantConfig(kernel=kernel).apply(layer)
        layers.append(layer)
    assert layers[0].quant_kernel.name == "cpu_int8"
    assert layers[0].quant_kernel.levels == layers[1].quant_kernel.levels
    for rows in (1, 5, 40):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layers[0](x), layers[1](x), rtol=1e-6, atol=1e-5)


def test_without_vnni_wide_activations_are_refused() -> None:
    q, scale = quantize_weight(torch.randn(16, 8))
    packed, rowsum = cpu_int8.pack(q)
    if "avx2" not in runnable_isas(63):
        pytest.skip("this CPU has no AVX2")
    with pytest.raises(RuntimeError, match="63"):
        cpu_int8.linear(torch.randn(1, 8), packed, rowsum, scale, 127, isa="avx2")


def test_zero_rows_and_zero_input() -> None:
    q, scale = quantize_weight(torch.randn(20, 12))
    packed, rowsum = cpu_int8.pack(q)
    assert cpu_int8.linear(torch.empty(0, 12), packed, rowsum, scale, 63).shape == (0, 20)
    assert torch.equal(
        cpu_int8.linear(torch.zeros(2, 12), packed, rowsum, scale, 63), torch.zeros(2, 20)
    )


def test_equals_onednn_kernel() -> None:
    """Same arithmetic as OneDNNKernel: the small-batch path does not change a token."""
    from pagedllm.layers.quantization import OneDNNKernel, _cpu_has_vnni

    torch.manual_seed(0)
    module = torch.nn.Module()
    q, scale = quantize_weight(torch.randn(48, 96))
    module.weight, module.weight_scale = q, scale
    onednn = OneDNNKernel(module, lambda x: x.abs().amax(dim=1, keepdim=True).float())
    x = torch.randn(4, 96)
    packed, rowsum = cpu_int8.pack(q)
    levels = 127 if _cpu_has_vnni() else 63
    got = cpu_int8.linear(x, packed, rowsum, scale, levels)
    torch.testing.assert_close(got, onednn.mm(x.clone()), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("m", [1, 16])
def test_any_number_of_threads_gives_the_same_bits(threads: int, m: int) -> None:
    """The blocks go to threads in chunks as they finish (balanced_for): 37 blocks of 16
    outputs over 2-3 threads, in chunks that do not divide them evenly."""
    torch.manual_seed(m)
    q, scale = quantize_weight(torch.randn(37 * 16, 4096))  # 64 KB blocks: a chunk each
    packed, rowsum = cpu_int8.pack(q)
    before = torch.get_num_threads()
    try:
        for _ in range(3):  # a new x each time: no output could pass as an earlier one
            x = torch.randn(m, 4096)
            torch.set_num_threads(1)
            want = cpu_int8.linear(x, packed, rowsum, scale, 127 if cpu_int8.has_vnni() else 63)
            torch.set_num_threads(threads)
            got = cpu_int8.linear(x, packed, rowsum, scale, 127 if cpu_int8.has_vnni() else 63)
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("m", [1, 3, 9, 48, 150])
def test_bf16_x_gives_the_float32_products_rounded_to_bf16_on_every_isa(m: int) -> None:
    """A bf16 x goes in as it is and y comes out in bf16: on every instruction set, the bits
    of the same x widened to fp32, multiplied, and rounded to bf16 by torch (150 rows at K =
    2048: more than one chunk of x)."""
    torch.manual_seed(m)
    k = 2048 if m == 150 else 130
    x = (torch.randn(m, k) * 3).bfloat16()
    q, scale = quantize_weight(torch.randn(40, k))
    packed, rowsum = cpu_int8.pack(q)
    for name in runnable_isas(63):
        got = cpu_int8.linear(x, packed, rowsum, scale, 63, isa=name)
        want = cpu_int8.linear(x.float(), packed, rowsum, scale, 63, isa=name).bfloat16()
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


@pytest.mark.parametrize("m", [3, 8, 9, 17, 48])
def test_many_rows_on_avx512_vnni_pass_two_weight_blocks_at_once_with_the_scalar_bits(
    m: int,
) -> None:
    """Beyond two rows, AVX-512 VNNI multiplies two weight blocks (32 outputs) a pass, up to 8
    rows: with 7 blocks (an odd one left to the one-block kernel) and with a partial last
    block (40 outputs), the outputs are the scalar kernel's; the pair passes are counted (one
    per 2 blocks and 8 rows), and one or two rows take none. Each pair with another pair
    after it requests that pair's lines (one a group of 4 inputs and block) while its passes
    run: 7 blocks, pairs 0-1 and 2-3 ask for 2-3 and 4-5; 3 blocks, none."""
    if "avx512_vnni" not in runnable_isas(127):
        pytest.skip("this CPU has no AVX-512 VNNI")
    torch.manual_seed(m)
    for n in (112, 40):
        x = torch.randn(m, 130) * 3
        q, scale = quantize_weight(torch.randn(n, 130))
        packed, rowsum = cpu_int8.pack(q)
        before, lines = cpu_int8.pair_passes(), cpu_int8.ahead_lines()
        got = cpu_int8.linear(x, packed, rowsum, scale, 127, isa="avx512_vnni")
        passes = cpu_int8.pair_passes() - before
        lines = cpu_int8.ahead_lines() - lines
        scalar = cpu_int8.linear(x, packed, rowsum, scale, 127, isa="scalar")
        assert torch.equal(got, scalar), (m, n)
        assert passes == -(-m // 8) * (n // 32), (m, n)
        assert lines == (2 * 2 * packed.size(1) if n == 112 else 0), (m, n)
    before, lines = cpu_int8.pair_passes(), cpu_int8.ahead_lines()
    cpu_int8.linear(torch.randn(2, 130), packed, rowsum, scale, 127, isa="avx512_vnni")
    assert (cpu_int8.pair_passes(), cpu_int8.ahead_lines()) == (before, lines)

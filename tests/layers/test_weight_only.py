"""Weight-only int8 / int4 kernels with group scales, and GGUF blocks repacked into them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.int8_activations import int8_activation_reference, int8_activations_on

from pagedllm.layers import gguf_repack, weight_only
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import DynamicQuantConfig, install_packed, weight_bytes

SHAPES = [
    (1, 64, 32, 32),
    (1, 576, 1536, 64),
    (3, 576, 577, 64),
    (8, 1536, 96, 128),
    (16, 256, 40, 32),
]


def _isas() -> list[str]:
    return [i for i in weight_only.ISAS if weight_only.cpu_runs(i)]


def _reference(x: torch.Tensor, packed: weight_only.PackedWeight) -> torch.Tensor:
    """x times the dequantized weight, in float64."""
    return (x.double() @ packed.dequantize().double().t()).float()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("m", "k", "n", "group"), SHAPES)
def test_kernel_matches_the_dequantized_product_on_every_isa(bits, m, k, n, group):
    torch.manual_seed(m * 7 + k + n)
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]  # rows of very different ranges
    x = torch.randn(m, k)
    packed = weight_only.quantize(w, bits, group)
    assert packed.group == group and packed.shape == (n, k)
    want = _reference(x, packed)
    tol = 1e-5 * (x.abs() @ packed.dequantize().abs().t()) + 1e-6
    isas = _isas()
    assert "scalar" in isas
    for isa in isas:
        got = weight_only.kernel_linear(x, packed, None, isa)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.all((got - want).abs() <= tol), isa


ROW_INT8 = weight_only.load() and bool(torch.ops.pagedllm_wo.int8_activations())
BEST_ISA = torch.ops.pagedllm_wo.isa() if weight_only.load() else "none"


@pytest.mark.skipif(not ROW_INT8, reason="the row kernel's int8 x needs AVX2")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("k", "n"), [(64, 33), (576, 100), (1536, 40), (288, 9)])
@pytest.mark.parametrize("group", ["32", "wider", "row"])
def test_rows_on_int8_x_match_rounded_x_and_residual_matches_fp32_x(bits, k, n, group):
    """The row layout's int8 x (AVX2): "int8" is x rounded per block of 32 times the weight,
    exactly, up to 4 rows (block counts with and without a partial group of eight blocks;
    groups of one block, of several, and one group a row); "int8_residual" (two int8 parts a
    row for int4 codes, x on int16 for int8 codes; up to 2 rows) within the second rounding's
    bound of the fp32 product. More rows: the next test."""
    torch.manual_seed(bits * k + n)
    size = {"32": 32, "wider": weight_only.group_size_for(k, 96), "row": k}[group]
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]
    packed = weight_only.quantize(w, bits, size)
    assert packed.group == size
    dense = packed.dequantize().double()
    for m in (1, 2, 4):
        x = torch.randn(m, k) * torch.logspace(-1, 1, k)
        rounded = weight_only.kernel_linear(x, packed, None, "int8")
        want = int8_activation_reference(x, packed)
        scale = x.abs().double() @ dense.abs().t()
        assert torch.all((rounded.double() - want).abs() <= 1e-5 * scale + 1e-6)
        exact = x.double() @ dense.t()
        block_max = x.abs().view(m, k // 32, 32).amax(-1, keepdim=True).expand(m, k // 32, 32)
        bound = (block_max.reshape(m, k).double() / 254**2) @ dense.abs().t()
        if m <= 2:
            residual = weight_only.kernel_linear(x, packed, None, "int8_residual").double()
            assert torch.all((residual - exact).abs() <= bound + 1e-5 * scale + 1e-6)
            rounding = (rounded.double() - exact).abs().max()
            assert rounding > 30 * (residual - exact).abs().max()


@pytest.mark.skipif(not ROW_INT8 or BEST_ISA != "avx2", reason="x on int16 where AVX2 is best")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("k", "n", "group"), [(64, 33, 32), (576, 100, 32), (1536, 40, 1536),
                                               (288, 9, 96)])  # fmt: skip
@pytest.mark.parametrize("half", [False, True], ids=["fp32-constants", "fp16-constants"])
def test_many_rows_on_int16_x_stay_within_its_rounding_and_do_not_depend_on_the_batch(
    bits, k, n, group, half
):
    """Beyond their rows by rows (4 for "int8", 2 for "int8_residual") both int8 forms round
    each row of x to int16 per block of 32 and multiply the codes in int16 panels (where AVX2
    is the best instruction set; the next test has AVX-512's): within that rounding's
    bound (half a step of the block's largest |x| / 32767) of the float64 product, with int4
    offsets and wider groups, fp32 or fp16 constants (a GGUF file's), a partial last panel
    (n % 16; 18 groups a row, 8 a transpose and 2 past them) and a partial tile of 4 rows. A
    row's result is the same bits in any batch and at any place in it, from 3 rows in the
    residual form."""
    torch.manual_seed(bits * k + n)
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]
    packed = weight_only.quantize(w, bits, group)
    if half:
        packed = weight_only.PackedWeight(
            bits, packed.qweight, packed.scale.half(),
            None if packed.offset is None else packed.offset.half(),
        )  # fmt: skip
    dense = packed.dequantize().double()
    x = torch.randn(41, k) * torch.logspace(-1, 1, k)
    block_max = x.abs().view(41, k // 32, 32).amax(-1, keepdim=True).expand(41, k // 32, 32)
    bound = (block_max.reshape(41, k).double() / 65534) @ dense.abs().t()
    slack = 2e-6 * (x.abs().double() @ dense.abs().t()) + 1e-6  # fp32 sums
    exact = x.double() @ dense.t()
    for form in ("int8", "int8_residual"):
        batch = weight_only.kernel_linear(x, packed, None, form)
        assert torch.all((batch.double() - exact).abs() <= bound + slack), form
        assert not torch.equal(batch, weight_only.kernel_linear(x, packed, None, "avx2"))
        three = (slice(30, 33),) if form == "int8_residual" else ()
        for rows in (slice(0, 5), slice(3, 14), slice(20, 41), *three):
            alone = weight_only.kernel_linear(x[rows], packed, None, form)
            assert torch.equal(alone, batch[rows]), (form, rows)


@pytest.mark.skipif(not ROW_INT8 or BEST_ISA != "avx512", reason="an AVX-512 CPU's rows")
@pytest.mark.parametrize("bits", [8, 4])
def test_int8_forms_beyond_their_rows_take_fp32_x_on_avx512(bits):
    """Where AVX-512 is the best instruction set, codes by rows keep fp32 x beyond the int8
    forms' rows (4 for "int8", 2 for "int8_residual"): the same bits as the float form at 5,
    16 and 41 rows, where within them x is rounded (and the result differs)."""
    torch.manual_seed(bits)
    packed = weight_only.quantize(torch.randn(40, 576), bits, 32)
    for form, rows in (("int8", 4), ("int8_residual", 2)):
        x = torch.randn(rows, 576)
        assert not torch.equal(weight_only.kernel_linear(x, packed, None, form),
                               weight_only.kernel_linear(x, packed, None, None)), form  # fmt: skip
        for m in (5, 16, 41):
            x = torch.randn(m, 576)
            want = weight_only.kernel_linear(x, packed, None, None)
            assert torch.equal(weight_only.kernel_linear(x, packed, None, form), want), (form, m)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_error_is_half_a_step_per_group(bits):
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    w[:, 64:128] *= 50  # one group of large values: its scale must not spread to the others
    packed = weight_only.quantize(w, bits, 64)
    step = packed.scale.repeat_interleave(64, dim=1)
    assert torch.all((packed.dequantize() - w).abs() <= step / 2 * 1.0001 + 1e-7)
    assert packed.scale[:, 0].max() < packed.scale[:, 1].min()  # the groups kept their own
    # codes + one fp32 scale (and offset) per group
    assert packed.nbytes() < w.numel() * (0.27 if bits == 8 else 0.16) * 4 + 1


def test_int4_codes_pack_in_gguf_block_order():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = weight_only.pack_int4(codes)
    assert packed.shape == (1, 32)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)  # feature j and j + 16 share a byte
    assert packed[0, 16] == codes[0, 32] | (codes[0, 48] << 4)
    assert torch.equal(weight_only.unpack_int4(packed), codes)


def test_bf16_activations_and_bias():
    torch.manual_seed(1)
    w, x, bias = torch.randn(40, 128), torch.randn(2, 128).bfloat16(), torch.randn(40)
    packed = weight_only.quantize(w, 4, 32)
    got = weight_only.kernel_linear(x, packed, bias)
    assert got.dtype == torch.bfloat16
    want = _reference(x.float(), packed) + bias
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_take_the_slices_or_slab_path_with_the_same_result(dtype):
    torch.manual_seed(2)
    w, x = torch.randn(300, 96), torch.randn(max(weight_only.KERNEL_MAX_ROWS.values()) + 5, 96)
    x = x.to(dtype)
    packed = weight_only.quantize(w, 4, 32)
    kernel_rows = weight_only.KERNEL_MAX_ROWS[weight_only.isa()]
    assert torch.ops.pagedllm_wo.kernel_max_rows() == kernel_rows
    tol = 1e-4 if dtype == torch.float32 else 0.25
    many = weight_only.linear(x, packed, None)  # AVX2: slices; else C++ slabs (bf16 tiles)
    assert many.dtype == dtype
    assert torch.allclose(many.float(), _reference(x.float(), packed), atol=tol, rtol=1e-2)
    assert torch.allclose(many.float(), weight_only.slab_linear(x, packed, None).float(),
                          atol=tol, rtol=1e-2)  # fmt: skip
    small = x[:kernel_rows]  # the kernel, unpacking in registers
    got = weight_only.linear(small, packed, None).float()
    assert torch.allclose(got, _reference(small.float(), packed), atol=tol, rtol=1e-2)


@pytest.mark.skipif(not weight_only.cpu_runs("avx2"), reason="the slices run on AVX2")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("m", "k", "n", "group"),
    [(9, 1536, 77, 1536), (13, 576, 49, 32), (50, 96, 300, 32), (23, 1536, 40, 96)],
)
def test_slices_on_avx2_match_the_dequantized_product(bits, m, k, n, group):
    """Beyond 8 rows AVX2 runs slices of the weight in fp32 panels of 16 rows (a partial last
    panel; at K = 1536 a slice is 2 panels, so 77 rows are 3 slices, split between threads)
    against tiles of 6 rows of x (a partial last tile): the float64 product within fp32
    rounding, with a bias, and a bf16 x back in bf16."""
    torch.manual_seed(m + k + n)
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]
    x, bias = torch.randn(m, k), torch.randn(n)
    packed = weight_only.quantize(w, bits, group)
    want = _reference(x, packed) + bias
    tol = 1e-5 * (x.abs() @ packed.dequantize().abs().t()) + 1e-5
    got = weight_only.kernel_linear(x, packed, bias, "avx2")
    assert got.shape == (m, n) and torch.all((got - want).abs() <= tol)
    assert torch.allclose(got, weight_only.kernel_linear(x, packed, bias, "scalar"),
                          rtol=1e-5, atol=1e-4)  # fmt: skip
    half = weight_only.kernel_linear(x.bfloat16(), packed, bias, "avx2")
    assert half.dtype == torch.bfloat16
    want_half = _reference(x.bfloat16().float(), packed) + bias
    assert torch.allclose(half.float(), want_half, rtol=1e-2, atol=1e-2 * want_half.abs().max())


def _widened(packed: weight_only.PackedWeight) -> weight_only.PackedWeight:
    offset = None if packed.offset is None else packed.offset.float()
    return weight_only.PackedWeight(packed.bits, packed.qweight, packed.scale.float(), offset)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("k", "n", "group"), [(160, 33, 32), (576, 100, 32), (576, 40, 96),
                                               (1536, 17, 32), (384, 9, 32),
                                               (448, 21, 32)])  # fmt: skip
def test_fp16_constants_give_their_fp32_widenings_result_on_every_path(bits, k, n, group):
    """A GGUF file's fp16 constants stay fp16 by rows: every path (each instruction set at 1-16
    rows, int8 x and its residual form, the slices or slabs beyond) gives what the same weight
    with its constants widened to fp32 gives, bit for bit. Block counts with a partial last
    eight (160: 5 blocks, 576: 18), a wider group (96: the groups eight blocks span, spread to
    them by a permute), and an odd row count, so the weight's last rows take the one-at-a-time
    load as well. On int8 x, int4 codes with fp16 constants, a group a block and an even block
    count take the Q4 kernel (rows_q4_avx2) and fp32 constants the general one: every count of
    blocks past the whole eights it has (0: 1536, 2: 576, 4: 384, 6: 448)."""
    torch.manual_seed(bits + k + n + group)
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]
    quantized = weight_only.quantize(w, bits, group)
    offset = None if quantized.offset is None else quantized.offset.half()
    half = weight_only.PackedWeight(bits, quantized.qweight, quantized.scale.half(), offset)
    widened = _widened(half)
    assert half.nbytes() < widened.nbytes()
    paths = [*_isas(), None] + (["int8", "int8_residual"] if ROW_INT8 else [])
    for m in (1, 2, 4, 9, 16, 40):
        x = torch.randn(m, k)
        for isa in paths:
            got = weight_only.kernel_linear(x, half, None, isa)
            assert torch.equal(got, weight_only.kernel_linear(x, widened, None, isa)), (m, isa)
    want = _reference(x, widened)
    assert torch.allclose(weight_only.linear(x[:1], half, None), want[:1], rtol=1e-4, atol=1e-3)


def test_group_size_falls_back_to_a_divisor():
    assert weight_only.group_size_for(1536, 128) == 128
    assert weight_only.group_size_for(576, 128) == 96  # 576 = 6 x 96
    assert weight_only.group_size_for(48, 128) is None
    with pytest.raises(ValueError, match="multiple of 32"):
        weight_only.group_size_for(64, 48)
    with pytest.raises(ValueError, match="group"):
        weight_only.quantize(torch.randn(4, 96), 4, 64)


def test_int4_config_quantizes_linear_layers_with_bounded_error():
    torch.manual_seed(3)
    layer = ReplicatedLinear(256, 64, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    x = torch.randn(5, 256)
    want, full = layer(x), weight_bytes(layer)
    assert DynamicQuantConfig(quant_dtype="int4", group_size=64).apply(layer) == [""]
    assert layer.quant_kernel.packed.bits == 4 and layer.quant_method.startswith("int4")
    err = (layer(x) - want).abs()
    step = layer.weight_group_scale.max()
    assert err.max() > 0 and torch.all(err <= x.abs().sum(1, keepdim=True) * step / 2 + 1e-4)
    assert weight_bytes(layer) < full * 0.2  # 4-bit codes + fp32 scale and offset per 64


# ---- GGUF blocks ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_repack_exactly(name):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 160)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    data = quantize(w, qtype)  # uint8 [rows, bytes per row], as GGUFReader gives them
    packed = gguf_repack.repack(data, int(qtype))
    assert packed.bits == (8 if name == "Q8_0" else 4) and packed.group == 32
    assert packed.shape == (48, 160)
    assert packed.scale.dtype == torch.float16  # the file's constants, as they are
    want = torch.from_numpy(np.array(dequantize(data, qtype)))
    assert torch.equal(packed.dequantize(), want.float())
    x = torch.randn(2, 160)
    got = weight_only.kernel_linear(x, packed)  # the fp16 constants by rows
    assert torch.allclose(got, x @ want.float().t(), rtol=1e-4, atol=1e-4)
    if weight_only.panels_run(packed):  # the panel kernel on the fp16 constants themselves
        panels = weight_only.in_panels(packed)
        assert panels.scale.dtype == torch.float16
        got = weight_only.panel_linear(x, panels, None)
        assert torch.allclose(got, x @ want.float().t(), rtol=1e-4, atol=1e-4)
    assert packed.qweight.numel() == 48 * 160 // (2 if packed.bits == 4 else 1)  # no fp copy


def test_gguf_repack_of_the_real_q4_1_file_matches_gguf_dequantize():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    from helpers.real_model import smollm2_gguf

    reader = gguf.GGUFReader(str(smollm2_gguf()))
    kinds = {}
    for tensor in reader.tensors:
        if gguf_repack.supported(tensor.tensor_type) and tensor.tensor_type.name not in kinds:
            packed = gguf_repack.repack(tensor.data, tensor.tensor_type)
            want = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
            assert torch.equal(packed.dequantize(), want.float()), tensor.name
            kinds[tensor.tensor_type.name] = tensor.name
    assert {"Q4_1", "Q8_0"} <= set(kinds)


def test_repacked_weights_run_in_a_layer_and_stack_by_rows():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 64)).astype(np.float32) for n in (32, 16, 16)]
    packed = [gguf_repack.repack(quantize(p, gguf.GGMLQuantizationType.Q4_1), 3) for p in parts]
    merged = gguf_repack.concat_rows(packed)
    layer = ReplicatedLinear(64, 64)
    install_packed(layer, merged)
    x = torch.randn(3, 64)
    want = x @ torch.cat([p.dequantize() for p in packed]).t()
    # fp32 x, or on int8 activations x as two int8 parts (x rounded, then what that left)
    assert torch.allclose(layer(x), want, atol=1e-3 if int8_activations_on() else 1e-4)
    if int8_activations_on():  # as a GGUF file's layers run: x rounded to int8 per block
        gguf_layer = ReplicatedLinear(64, 64)
        install_packed(gguf_layer, merged, int8_x=True)
        rounded = int8_activation_reference(x, weight_only.in_panels(merged)).float()
        assert torch.allclose(gguf_layer(x), rounded, atol=1e-4)
        assert not torch.allclose(gguf_layer(x), want, atol=1e-2)
    order = torch.randperm(64)
    swapped = gguf_repack.select_rows(merged, order)
    assert torch.equal(swapped.dequantize(), merged.dequantize()[order])
    with pytest.raises(ValueError, match="packed weight"):
        install_packed(ReplicatedLinear(64, 8), merged)
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0, Q4_K"):
        gguf_repack.repack(np.zeros((2, 20), np.uint8), 14)  # Q6_K


def test_q4_k_super_blocks_repack_exactly():
    """Q4_K (random bytes are valid blocks: any scales, mins and nibbles): group-32 int4 equal
    to gguf's own dequantization bit for bit, and the kernel runs it."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    rng = np.random.default_rng(4)
    rows, features = 24, 512
    data = rng.integers(0, 256, (rows, features // 256 * 144), dtype=np.uint8)
    constants = data.reshape(rows, -1, 144)[:, :, :4].view(np.float16)
    constants[:] = rng.uniform(0.001, 0.05, constants.shape).astype(np.float16)  # d, dmin
    packed = gguf_repack.repack(data, int(gguf.GGMLQuantizationType.Q4_K))
    assert packed.bits == 4 and packed.group == 32 and packed.shape == (rows, features)
    want = torch.from_numpy(np.array(dequantize(data, gguf.GGMLQuantizationType.Q4_K)))
    assert torch.equal(packed.dequantize(), want.float())
    x = torch.randn(3, features)
    assert torch.allclose(weight_only.kernel_linear(x, packed), _reference(x, packed), atol=1e-3)

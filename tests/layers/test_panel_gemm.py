"""The panel GEMM (layers/panel_gemm.py, csrc/panel_gemm.cpp): layout, products at every row
count against float64, bf16 rounding, and the loader moving float layers into panels."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.disassembly import kernel_bodies, loaded_library
from helpers.int8_activations import int8_activation_reference, panels_on_vnni

from pagedllm.layers import panel_gemm

pytestmark = pytest.mark.skipif(
    not panel_gemm.available(), reason="the panel GEMM needs AVX-512F or AVX2 with FMA"
)

# The bf16 paths this CPU runs: AMX tiles beyond 6 rows where it has AMX-BF16, the dot-product
# instruction where it has AVX512-BF16, the two-FMA path every AVX-512 CPU runs, and the AVX2
# tiles every one of these CPUs runs. float32 has two: AVX-512 and AVX2.
ISAS = ["avx2", "avx512", "avx512_bf16", "amx_bf16"]  # each CPU runs its own and those before
AMX = panel_gemm.isa() == "amx_bf16"
BF16_ISAS = ISAS[: ISAS.index(panel_gemm.isa()) + 1] if panel_gemm.isa() in ISAS else []
FP32_ISAS = BF16_ISAS[:2]
AVX512 = "avx512" in BF16_ISAS
# weight-only codes in panels (AVX-512F; an AVX2 CPU keeps them by rows)
QUANT = pytest.mark.skipif(
    not panel_gemm.quantized_available(), reason="quantized panels need AVX-512F"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trips_and_puts_16_outputs_of_one_input_side_by_side(dtype):
    w = torch.randn(48, 10).to(dtype)
    panels = panel_gemm.pack(w)
    assert torch.equal(panel_gemm.unpack(panels), w)
    assert panels.shape[2] * panels.element_size() == 64  # one 512-bit vector per step
    if dtype == torch.float32:
        assert panels.shape == (3, 10, 16)
        assert torch.equal(panels[1, 7], w[16:32, 7])
    else:  # pairs of inputs: (w[n, 2k], w[n, 2k + 1]) for the panel's 16 outputs
        assert panels.shape == (3, 5, 32)
        assert torch.equal(panels[2, 3].view(16, 2), w[32:48, 6:8])


def test_only_cpu_float_weights_that_split_into_panels_pack():
    assert panel_gemm.packable(torch.zeros(32, 8))
    assert not panel_gemm.packable(torch.zeros(40, 8))  # 40 outputs: not whole panels
    assert not panel_gemm.packable(torch.zeros(32, 7, dtype=torch.bfloat16))  # odd K in pairs
    assert not panel_gemm.packable(torch.zeros(32, 8, dtype=torch.float16))
    assert not panel_gemm.packable(torch.zeros(32, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="cannot pack"):
        panel_gemm.pack(torch.zeros(40, 8))


CASES = [
    *((torch.float32, isa, 1e-5) for isa in FP32_ISAS),
    *((torch.bfloat16, isa, 1e-2) for isa in BF16_ISAS),
]


@pytest.mark.parametrize("dtype,isa,tol", CASES)
@pytest.mark.parametrize("n,k", [(64, 64), (960, 576), (48, 6002)])  # 6002: K in slices
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 131])
def test_products_match_float64_at_every_row_count(dtype, isa, tol, n, k, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    panels = panel_gemm.pack(w)
    ref = x.double() @ w.double().T
    for bias in (None, b):
        y = panel_gemm.linear(x, panels, bias, isa)
        assert y.dtype == dtype and y.shape == (rows, n)
        want = ref if bias is None else ref + b.double()
        assert (y.double() - want).abs().max() <= tol * want.abs().max()


def test_a_thread_done_with_its_share_takes_chunks_from_the_far_end_of_another():
    """balanced_for, through its trace op: thread 0 is held in its first claim (a quarter of
    its share, at least a chunk); thread 1 runs its own share in order, then thread 0's
    remaining chunks one at a time from the back."""
    trace = torch.ops.pagedllm_panel.balanced_split_trace
    # (thread, place in its order) per chunk; shares [0, 3) / [3, 6), then [0, 3) / [3, 7)
    assert trace(6).tolist() == [[0, 0], [1, 4], [1, 3], [1, 0], [1, 1], [1, 2]]
    assert trace(7).tolist() == [[0, 0], [1, 5], [1, 4], [1, 0], [1, 1], [1, 2], [1, 3]]
    # shares of 10: thread 0 claims chunks 0-1 at once; thread 1 steals 9 down to 2
    assert trace(20).tolist() == [[0, 0], [0, 1]] + [[1, 19 - c] for c in range(2, 10)] + [
        [1, c] for c in range(10)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_of_few_panel_groups_split_into_blocks_of_rows_with_the_same_bits(dtype):
    """Beyond 6 rows, a product of few panel groups (SmolLM2's 576 outputs: 9 groups of 4
    panels) hands the threads (group, block of rows) items, about 16 a thread, where whole
    groups left one thread a group more; many groups, 6 rows or a K in slices keep whole
    groups. Each output's sums run in the same order either way: the bits are those of the
    rows taken 6 at a time (the streaming path, one item)."""
    torch.manual_seed(9)
    isa = "avx512_bf16" if AMX and dtype == torch.bfloat16 else None  # AMX keeps whole groups
    few = panel_gemm.pack(torch.randn(576, 64).to(dtype))
    x = torch.randn(131, 64).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        start = panel_gemm.row_blocks()
        y = panel_gemm.linear(x, few, None, isa)
        # 22 tiles of 6 rows in 4 blocks of 36 rows (9 groups x 4 blocks >= 32 items)
        assert panel_gemm.row_blocks() - start == 9 * 4
        by_six = torch.cat(
            [panel_gemm.linear(x[r : r + 6], few, None, isa) for r in range(0, 131, 6)]
        )
        assert torch.equal(y, by_six)
        start = panel_gemm.row_blocks()
        many = panel_gemm.pack(torch.randn(32 * 64, 64).to(dtype))  # 32 groups: whole ones
        panel_gemm.linear(x, many, None, isa)
        panel_gemm.linear(x[:6], few, None, isa)
        sliced = panel_gemm.pack(torch.randn(48, 6002).to(dtype))
        panel_gemm.linear(torch.randn(131, 6002).to(dtype), sliced, None, isa)
        assert panel_gemm.row_blocks() == start
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_tiles_request_each_panel_group_but_the_first_once_ahead(dtype):
    """Beyond 6 rows each row tile asks for its share of the next panel group's lines (of the
    same slice of K) while it computes, so that the next group's first tile does not wait on
    memory. On one thread each group's slice but the first is asked for once (a line: one
    step of K of a panel, 16 fp32 inputs or 16 bf16 pairs). 64 rows, 4 groups of 4 panels,
    K = 128: 3 groups. K = 2,048 in slices of 768 steps, 2 groups: all but the first group's
    first slice. 6 rows stream the weight and request their own lines (none counted here)."""
    isa = "avx512_bf16" if AMX and dtype == torch.bfloat16 else None  # AMX: its own tiles
    steps = lambda k: k if dtype == torch.float32 else k // 2  # noqa: E731
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows, (n, k), lines in (
            (64, (256, 128), 3 * 4 * steps(128)),
            (64, (128, 2048), 4 * (2 * steps(2048) - 768)),
            (6, (256, 128), 0),
        ):
            w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
            start = panel_gemm.ahead_lines()
            y = panel_gemm.linear(x, panel_gemm.pack(w), None, isa)
            assert panel_gemm.ahead_lines() - start == lines, (rows, n, k)
            want = x.double() @ w.double().T
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(y.double(), want, atol=tol * k**0.5, rtol=tol)
    finally:
        torch.set_num_threads(before)


@QUANT
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_products_of_many_rows_request_each_slice_but_the_first_once_ahead(bits):
    """Beyond 8 rows a quantized product dequantizes a slice of 1,024 input features of a panel
    group at a time; while the row tiles run on it, they request the codes of the next slice
    (the group's, else the next group's first). On one thread each slice's codes but the first
    are requested once: 2 groups x 2 slices of 32 blocks, 4 panels a block of 512 bytes (int8)
    or 256 (int4): 3 slices' lines. 8 rows take the small-row kernels (none counted here)."""
    from pagedllm.layers import weight_only

    isa = "avx512_bf16" if AMX else None  # AMX: its own tiles
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(128, 2048), bits, 32))
    w = packed.dequantize()
    slice_lines = 32 * 4 * (512 if bits == 8 else 256) // 64
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows, lines in ((16, 3 * slice_lines), (8, 0)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, 2048).to(dtype)
                start = panel_gemm.ahead_lines()
                y = weight_only.panel_linear(x, packed, None, isa)
                assert panel_gemm.ahead_lines() - start == lines, (rows, dtype)
                want = x.double() @ w.double().T
                tol = 1e-4 if dtype == torch.float32 else 5e-2
                torch.testing.assert_close(y.double(), want, atol=tol * 2048**0.5, rtol=tol)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_panel_products_give_the_same_bits_on_any_number_of_threads(threads):
    """Every panel product hands chunks of panels to threads as they finish (few rows
    streaming, many rows sliced or on AMX tiles): whichever thread computes an output, its
    sums run in the same order. 37 and 19 panels: shares and chunks that do not divide evenly."""
    from pagedllm.layers import weight_only

    torch.manual_seed(threads)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        panels = panel_gemm.pack(torch.randn(37 * 16, 320).to(dtype))
        cases += [(lambda x, p=panels: panel_gemm.linear(x, p, None), dtype, 320, rows)
                  for rows in (1, 6, 40)]  # fmt: skip
    for bits in (4, 8) if panel_gemm.quantized_available() else ():
        packed = weight_only.in_panels(weight_only.quantize(torch.randn(19 * 16, 576), bits, 32))
        cases += [(lambda x, p=packed: weight_only.panel_linear(x, p, None), dtype, 576, rows)
                  for dtype in (torch.float32, torch.bfloat16) for rows in (1, 8, 40)]  # fmt: skip
    before = torch.get_num_threads()
    try:
        for product, dtype, k, rows in cases:
            for _ in range(3):  # a new x each time: no output could pass as an earlier one
                x = torch.randn(rows, k).to(dtype)
                torch.set_num_threads(1)
                want = product(x)
                torch.set_num_threads(threads)
                assert torch.equal(product(x), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU (or no tile state from the kernel)")
def test_bf16_products_of_more_than_six_rows_run_on_amx_tiles():
    """Beyond 6 rows a bf16 product (float panels, or a quantized weight's dequantized slices)
    runs on AMX in blocks of 16 rows, the last padded; 6 rows and an explicit AVX512-BF16 do
    not, and the tiles agree with it to bf16 rounding."""
    from pagedllm.layers import weight_only

    torch.manual_seed(0)
    w = torch.randn(80, 576).to(torch.bfloat16)
    panels = panel_gemm.pack(w)
    before = panel_gemm.amx_blocks()
    panel_gemm.linear(torch.randn(6, 576).to(torch.bfloat16), panels, None)
    panel_gemm.linear(torch.randn(40, 576).to(torch.bfloat16), panels, None, "avx512_bf16")
    assert panel_gemm.amx_blocks() == before
    x = torch.randn(40, 576).to(torch.bfloat16)
    y = panel_gemm.linear(x, panels, None)
    grew = panel_gemm.amx_blocks() - before
    assert grew > 0 and grew % 3 == 0  # 40 rows: 3 blocks of 16 for each group of panels
    torch.testing.assert_close(y, panel_gemm.linear(x, panels, None, "avx512_bf16"),
                               rtol=8e-3, atol=0)  # fmt: skip
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(96, 1536), 4, 32))
    before = panel_gemm.amx_blocks()
    y = weight_only.panel_linear(torch.randn(20, 1536).to(torch.bfloat16), packed, None, None)
    assert panel_gemm.amx_blocks() > before
    assert y.shape == (20, 96)


def test_products_take_leading_dims_and_strided_rows():
    w = torch.randn(32, 24)
    panels = panel_gemm.pack(w)
    x = torch.randn(2, 3, 40)[..., 8:32]  # rows 40 apart
    y = panel_gemm.linear(x, panels, None)
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("rows", [4, 16])  # 16: on AMX tiles where the CPU has them
def test_bf16_outputs_round_to_nearest_even_like_torch(isa, rows):
    # One input pair (x0, 0): each output is one fp32 product, exact, then rounded to bf16.
    torch.manual_seed(0)
    x = torch.zeros(rows, 32, dtype=torch.bfloat16)
    x[:, 0] = torch.randn(rows).to(torch.bfloat16)
    w = torch.zeros(256, 32, dtype=torch.bfloat16)
    w[:, 0] = torch.randn(256).to(torch.bfloat16)
    y = panel_gemm.linear(x, panel_gemm.pack(w), None, isa)
    want = (x[:, :1].float() * w[:, 0].float()).to(torch.bfloat16)
    assert torch.equal(y, want)
    x[0, 0] = float("nan")
    assert torch.isnan(panel_gemm.linear(x, panel_gemm.pack(w), None, isa)[0]).all()


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("rows,k", [(1, 576), (5, 576), (7, 576), (64, 768), (9, 6002)])
def test_bf16_products_in_float32_hold_the_widened_bf16_results(isa, rows, k):
    """out_dtype float32 (an LM head's logits): y holds exactly .float() of the bfloat16 y, on
    every tile path (one row, a few, many, K in slices; AMX where the CPU has it)."""
    torch.manual_seed(rows)
    w = panel_gemm.pack(torch.randn(96, k).to(torch.bfloat16))
    x, bias = torch.randn(rows, k).to(torch.bfloat16), torch.randn(96)
    for b in (None, bias):
        y = panel_gemm.linear(x, w, b, isa, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        assert torch.equal(y, panel_gemm.linear(x, w, b, isa).float())
    fp32 = panel_gemm.pack(torch.randn(96, k))  # float32 x: out_dtype float32 is its own dtype
    x32 = torch.randn(rows, k)
    assert torch.equal(
        panel_gemm.linear(x32, fp32, None, out_dtype=torch.float32),
        panel_gemm.linear(x32, fp32, None),
    )
    with pytest.raises(RuntimeError, match="out_dtype is x's dtype or float32"):
        panel_gemm.linear(x32, fp32, None, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_panels_are_the_plain_weights_rows(dtype):
    """The embedding lookup in panels (the C++ gather): any ids, repeated, in any order; an id
    outside the table is refused."""
    w = torch.randn(80, 24).to(dtype)
    panels = panel_gemm.pack(w)
    ids = torch.tensor([0, 79, 17, 17, 16, 15, 64, 3])
    assert torch.equal(panel_gemm.rows(panels, ids), w[ids])
    assert panel_gemm.rows(panels, ids[:0]).shape == (0, 24)
    with pytest.raises(RuntimeError, match=r"id 80 outside \[0, 80\)"):
        panel_gemm.rows(panels, torch.tensor([2, 80]))


def test_an_unknown_isa_or_one_the_cpu_lacks_is_refused():
    w = panel_gemm.pack(torch.randn(16, 4))
    with pytest.raises(RuntimeError, match="isa is amx_bf16, avx512_bf16, avx512 or avx2"):
        panel_gemm.linear(torch.randn(1, 4), w, None, "sse4")
    lacking = [isa for isa in ISAS if isa not in BF16_ISAS]
    for isa in lacking:
        with pytest.raises(RuntimeError, match="this CPU lacks"):
            panel_gemm.linear(torch.randn(1, 4), w, None, isa)
    if not AVX512:  # an AVX2 CPU: codes in panels are refused, not run on missing instructions
        from pagedllm.layers import weight_only

        codes = weight_only.in_panels(weight_only.quantize(torch.randn(16, 64), 8, 32))
        with pytest.raises(RuntimeError, match="quantized panels need AVX-512F"):
            weight_only.panel_linear(torch.randn(1, 64), codes, None)


@pytest.mark.skipif(not AVX512, reason="no AVX-512F on this CPU: its kernels cannot run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 576), (3, 576), (6, 1536), (13, 576), (131, 6002)])
def test_avx2_tiles_give_the_bits_of_the_avx512_kernels(dtype, rows, k):
    """The AVX2 tiles run each output's sums in the AVX-512 kernels' order (one FMA a feature,
    K in the same slices; bf16 the even feature of a pair, then the odd): the same bits, at
    one row, a few, many and K in slices, with a bias and widened bf16 logits."""
    torch.manual_seed(rows)
    panels = panel_gemm.pack(torch.randn(96, k).to(dtype))
    x, bias = torch.randn(rows, k).to(dtype), torch.randn(96).to(dtype)
    for b in (None, bias):
        assert torch.equal(panel_gemm.linear(x, panels, b, "avx2"),
                           panel_gemm.linear(x, panels, b, "avx512"))  # fmt: skip
    assert torch.equal(
        panel_gemm.linear(x, panels, None, "avx2", out_dtype=torch.float32),
        panel_gemm.linear(x, panels, None, "avx512", out_dtype=torch.float32),
    )


def _load(folder, dtype: str):
    from pagedllm.config import EngineArgs
    from pagedllm.models.loader import load_model

    config = EngineArgs(model=str(folder), dtype=dtype).create_engine_config()
    return load_model(config.model, torch.device("cpu"))


def _plain_load(folder, dtype: str, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_PANEL_WEIGHTS", "0")
    panel_gemm.available.cache_clear()
    try:
        return _load(folder, dtype)
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_PANEL_WEIGHTS")
        panel_gemm.available.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loader_moves_every_float_linear_into_panels_with_the_same_products(
    tiny_llama, monkeypatch, dtype
):
    from pagedllm.layers.linear import LinearBase
    from pagedllm.layers.quantization import weight_bytes

    model = _load(tiny_llama, dtype)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight_panels is not None for m in linears)
    assert all(m.weight.numel() == 0 and m.weight.dtype == m.weight_panels.dtype for m in linears)
    assert all(m.fused_operands()[0][0] is m.weight_panels for m in linears)

    plain = _plain_load(tiny_llama, dtype, monkeypatch)
    plain_linears = [m for m in plain.modules() if isinstance(m, LinearBase)]
    assert all(m.weight_panels is None and m.weight.dim() == 2 for m in plain_linears)
    assert weight_bytes(model) == weight_bytes(plain)  # one copy of each weight, not two

    tol = 1e-5 if dtype == "float32" else 2e-2
    for m, p in zip(linears, plain_linears):
        assert torch.equal(panel_gemm.unpack(m.weight_panels), p.weight)
        x = torch.randn(5, p.weight.shape[1]).to(p.weight.dtype)
        torch.testing.assert_close(m(x), p(x), rtol=tol, atol=tol)
    panel_gemm.unpack_layers([m])
    assert m.weight_panels is None and torch.equal(m.weight, p.weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_embedding_and_lm_head_share_one_set_of_panels(model_factory, monkeypatch, dtype):
    folder = model_factory("llama", tie_word_embeddings=True)
    model, plain = _load(folder, dtype), _plain_load(folder, dtype, monkeypatch)
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.weight_panels is not None and head.weight_panels is embed.weight_panels
    assert head.weight is embed.weight  # the tie, on the empty placeholder too
    ids = torch.tensor([0, 17, 5, 255, 17])
    assert torch.equal(embed(ids), plain.model.embed_tokens(ids))
    hidden = torch.randn(3, embed.weight_panels.shape[1] * embed.weight_panels.shape[2] // 16)
    hidden = hidden.to(embed.weight_panels.dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(head(hidden), plain.lm_head(hidden), rtol=tol, atol=tol)
    logits = model.compute_logits(hidden)  # float32, written by the product itself
    assert logits.dtype == torch.float32 and torch.equal(logits, head(hidden).float())
    panel_gemm.unpack_layers([embed, head])  # back to one shared plain weight
    assert head.weight is embed.weight and torch.equal(
        embed.weight, plain.model.embed_tokens.weight
    )


# ---- quantized panels (weight-only int8 / int4) -------------------------------------------
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 192)])
def test_quantized_weights_round_trip_through_panels(bits, group):
    from pagedllm.layers import weight_only

    # 5 panels: a group of four and one alone
    rows = weight_only.quantize(torch.randn(80, 192), bits, group)
    panels = weight_only.in_panels(rows)
    assert panels.panels and panels.shape == rows.shape == (80, 192)
    assert panels.group == rows.group == group
    assert panels.qweight.shape == (5, 192 // (2 if bits == 4 else 1), 16)
    assert panels.scale.shape == (5, 192 // group, 16)
    back = weight_only.by_rows(panels)
    assert torch.equal(back.qweight, rows.qweight) and torch.equal(back.scale, rows.scale)
    assert torch.equal(panels.dequantize(), rows.dequantize())
    ids = torch.tensor([79, 0, 17, 64, 33])  # rows gathered from their panels, the tail's too
    assert torch.equal(panels.dequantize(ids), rows.dequantize(ids))
    with pytest.raises(RuntimeError, match="outside"):
        panels.dequantize(torch.tensor([80]))
    if bits == 4:  # step s of panel p: features 2s, 2s + 1 of its 16 outputs, low nibble first
        codes = weight_only.unpack_int4(rows.qweight)
        stored = panels.qweight.reshape(-1, 16)  # 16 outputs a step, in storage order
        # the four panels of a group side by side per block of 16 steps, then the next block:
        # panel 1's steps 5 and 21 (blocks 0 and 1); panel 4, alone in its group, step 21
        for panel, step, at in ((1, 5, 1 * 16 + 5), (1, 21, (4 + 1) * 16 + 5),
                                (4, 21, 4 * 96 + 21)):  # fmt: skip
            outputs = slice(16 * panel, 16 * panel + 16)
            assert torch.equal(stored[at] & 0xF, codes[outputs, 2 * step].to(torch.uint8))
            assert torch.equal(stored[at] >> 4, codes[outputs, 2 * step + 1].to(torch.uint8))
    # the constants likewise, per group of features: panel 2's second group, panel 4's first
    stored = panels.scale.reshape(-1, 16)
    groups = 192 // group
    if groups > 1:
        assert torch.equal(stored[4 + 2], rows.scale[32:48, 1])
    assert torch.equal(stored[4 * groups], rows.scale[64:80, 0])


# K = 1536 and 2112: more than one dequantized slice (1,024 features) of a panel group
QUANT_SHAPES = [
    (4, 64, 64, 32),
    (4, 96, 576, 64),
    (8, 48, 1536, 1536),
    (8, 32, 320, 32),
    (4, 32, 2112, 32),
]
VNNI = panels_on_vnni()


@QUANT
@pytest.mark.parametrize(
    "dtype,isa,tol",
    [(torch.float32, "avx512", 1e-5)] + [c for c in CASES if c[0] == torch.bfloat16][1:],
)
@pytest.mark.parametrize("bits,n,k,group", QUANT_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13, 64])  # <= 8: in registers, beyond: scratch
def test_quantized_panel_products_match_the_dequantized_weight(dtype, isa, tol, bits, n, k,
                                                               group, rows):  # fmt: skip
    """x exact in fp32 (an explicit float isa): against x W^T of the dequantized weight."""
    from pagedllm.layers import weight_only

    torch.manual_seed(rows)
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(n, k), bits, group))
    w = packed.dequantize().double()
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    for bias in (None, b):
        y = weight_only.panel_linear(x, packed, bias, isa)
        assert y.dtype == dtype and y.shape == (rows, n)
        want = x.double() @ w.T + (0 if bias is None else b.double())
        assert (y.double() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI / VBMI on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group", QUANT_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_int8_activation_products_match_their_reference(dtype, bits, n, k, group, rows):
    """Up to 4 rows on VNNI (GGUF layers ask for it): exact integer dot products of the codes
    with x rounded per block, so within float rounding of that reference, and within the
    rounding's own error of the exact product."""
    from pagedllm.layers import weight_only

    torch.manual_seed(rows)
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(n, k), bits, group))
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    y = weight_only.panel_linear(x, packed, b, "avx512_vnni")
    assert torch.equal(y, weight_only.linear(x, packed, b, "int8"))  # what GGUF layers run
    want = int8_activation_reference(x, packed) + b.double()
    exact = x.double() @ packed.dequantize().double().T + b.double()
    scale = exact.abs().max()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # y itself is rounded to dtype
    assert (y.double() - want).abs().max() <= tol * scale
    assert (y.double() - exact).abs().max() <= 3e-2 * scale  # what int8 activations cost
    assert (y.double() - exact).abs().max() > 1e-5 * scale  # and they did run


@pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI / VBMI on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group", QUANT_SHAPES)
@pytest.mark.parametrize("rows", [5, 9, 48, 131])
def test_a_decode_steps_rows_take_int8_activations_at_any_count(dtype, bits, n, k, group, rows):
    """A decode step's rows ("avx512_vnni_all", the "int8_decode" form): every row rounded to
    int8 as one row alone is, so each row's product has the bits of that row run by itself
    (the rows prepared on both threads); "avx512_vnni" keeps rows past 4 float (a prompt's)."""
    from pagedllm.layers import weight_only

    torch.manual_seed(rows)
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(n, k), bits, group))
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = weight_only.panel_linear(x, packed, b, "avx512_vnni_all")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y, weight_only.linear(x, packed, b, "int8_decode"))
    alone = torch.cat([weight_only.panel_linear(x[r : r + 1], packed, b, "avx512_vnni")
                       for r in range(rows)])  # fmt: skip
    assert torch.equal(y, alone)
    want = int8_activation_reference(x, packed) + b.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.double() - want).abs().max() <= tol * want.abs().max()
    prompt_rows = weight_only.panel_linear(x, packed, b, "avx512_vnni")
    assert torch.equal(prompt_rows, weight_only.panel_linear(x, packed, b, None))
    assert not torch.equal(prompt_rows, y)


@pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI / VBMI on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group", QUANT_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_residual_int8_activation_products_keep_fp32_accuracy(dtype, bits, n, k, group, rows):
    """One row as two int8 rows (rounded, then what the rounding left; LM heads ask for it):
    within 1e-4 of the exact product where one int8 row is ~1e-2 off; more rows take the
    fp32 path."""
    from pagedllm.layers import weight_only

    torch.manual_seed(rows)
    packed = weight_only.in_panels(weight_only.quantize(torch.randn(n, k), bits, group))
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    y = weight_only.panel_linear(x, packed, b, "avx512_vnni_residual")
    assert torch.equal(y, weight_only.linear(x, packed, b, "int8_residual"))
    assert y.dtype == dtype and y.shape == (rows, n)
    exact = x.double() @ packed.dequantize().double().T + b.double()
    scale = exact.abs().max()
    if dtype == torch.float32:
        assert (y.double() - exact).abs().max() <= 1e-4 * scale
        one_part = weight_only.panel_linear(x, packed, b, "avx512_vnni")
        assert (one_part.double() - exact).abs().max() > 1e-3 * scale
    else:  # y rounded to bf16: as close as the fp32 path's
        fp32_path = weight_only.panel_linear(x, packed, b, None)
        worst = (fp32_path.double() - exact).abs().max()
        assert (y.double() - exact).abs().max() <= worst + 1e-4 * scale
    fp32_path_equal = torch.equal(y, weight_only.panel_linear(x, packed, b, None))
    if rows > 1:
        assert fp32_path_equal
    elif dtype == torch.float32:  # the two parts did run: not the fp32 path's sums
        assert not fp32_path_equal


def panel_library() -> str:
    """The path of the built panel GEMM library, loaded."""
    panel_gemm.load()
    return loaded_library("pagedllm_panel")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_streaming_kernels_request_their_weight_ahead_into_l2():
    """Every instantiation of the kernels that stream a weight at a few rows carries its
    software prefetch (prefetcht1) in the built library: the stream's requests ahead or, in
    the instantiations for distance 0 (Zen 5 streams without them), the requests of the next
    panel group that those kernels make at many rows. GCC 12 once dropped the intrinsic from
    an inline helper without a word, which no product test can see: the products were right,
    only slower."""
    library = panel_library()
    kernels = (
        "quant_tile_small<1,",
        "quant_tile_small<2,",
        "quant_tile_vnni<",
        "tile_f32<",
        "tile_bf16_dp<",
        "tile_bf16_fma<",
        "avx2_block<",
    )
    for kernel in kernels:
        bodies = kernel_bodies(library, kernel.replace(",", ", "))
        assert bodies, f"no {kernel} in {library}"
        for name, body in bodies.items():
            assert "prefetcht1" in body, f"{name} requests nothing ahead"


def _cpuinfo(field: str) -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


def test_streaming_tiles_request_ahead_by_the_cpus_vendor_family_and_dtype():
    """How far ahead a row tile streaming a float weight requests it, as CPUID gives the
    kernel vendor, family and vector width, checked against /proc/cpuinfo's: none on AMD
    family 26 (Zen 5, whose own prefetchers stream faster alone), 1 KB on older AMD cores but
    none for one row of float32 on those without AVX-512 (Zen 3's AVX2 tiles; several rows
    take bf16's distance), 2 KB elsewhere. The products' bits are the same either way (the
    products' tests run this CPU's choice)."""
    vendor, family = _cpuinfo("vendor_id"), _cpuinfo("cpu family")
    if not family.isdigit():
        pytest.skip("no CPU family in /proc/cpuinfo")
    bf16 = fp32 = 2048
    if vendor == "AuthenticAMD":
        bf16 = 0 if int(family) >= 26 else 1024
        fp32 = 0 if "avx512f" not in _cpuinfo("flags").split() else bf16
    distance = torch.ops.pagedllm_panel.stream_ahead_bytes
    assert (distance(), distance(dtype=torch.bfloat16)) == (fp32, bf16)
    assert distance(dtype=torch.float32) == fp32


def stack_stores_in_loops(body: str) -> list[str]:
    """The stores of a vector register to the stack inside the innermost loop around each
    multiply-add of a disassembled function: from the target of the first backward conditional
    jump after it that jumps to or before it (the latch GCC's rotated loops end with) to that
    jump. An unconditional backward jump is a block laid out after the function's return
    jumping back, and would take in the epilogue; so would the smallest range of a backward
    jump around the multiply-add, where such a block's conditional jump goes back into the
    loop from beyond its latch."""
    lines = []
    for line in body.splitlines():
        match = re.match(r"\s*([0-9a-f]+):\s+(.*)", line)
        if match:
            lines.append((int(match[1], 16), match[2]))
    loops = []
    for at, text in lines:
        jump = re.match(r"^j(?!mp)\w+\s+([0-9a-f]+)\s", text)
        if jump and int(jump[1], 16) < at:
            loops.append((int(jump[1], 16), at))
    math = re.compile(r"^(vfmadd231ps|vdpbf16ps|vpdpbusd)\s")
    innermost = set()
    for at, text in lines:
        latches = [(end, start) for start, end in loops if start <= at <= end]
        if math.match(text) and latches:
            end, start = min(latches)
            innermost.add((start, end))
    spill = re.compile(r"^vmov\w+\s+%[yz]mm\d+,.*\(%rsp\)")
    return [t for start, end in sorted(innermost) for a, t in lines
            if start <= a <= end and spill.match(t)]  # fmt: skip


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_micro_kernels_keep_their_sums_in_registers_across_the_k_loop():
    """No micro-kernel stores its sums to the stack on every step of K. A prefetch written as
    an asm statement with a memory operand once made GCC keep every float tile's 24 sums in
    memory, storing them each step (fp32 panels at 32-64 rows ran at half of oneDNN's rate);
    the address now goes in a register. Like the prefetch, only the library shows it. (Left
    out: the kernels that run short of the 32 vector registers by design, the two-FMA bf16
    fallback and the fp32 unpacking of codes at 3-4 rows.)"""
    library = panel_library()
    kernels = ("tile_f32<", "tile_bf16_dp<", "avx2_block<", "quant_tile_small<1,",
               "quant_tile_small<2,", "quant_tile_vnni<")  # fmt: skip
    for kernel in kernels:
        bodies = kernel_bodies(library, kernel.replace(",", ", "))
        assert bodies, f"no {kernel} in {library}"
        for name, body in bodies.items():
            assert stack_stores_in_loops(body) == [], f"{name} stores its sums every step"


@QUANT
def test_installed_weight_only_layers_keep_one_copy_in_panels(tiny_llama):
    from pagedllm.config import EngineArgs
    from pagedllm.layers import weight_only
    from pagedllm.models.loader import load_model

    for quantization, bits in (("int8", 8), ("int4", 4)):
        args = EngineArgs(model=str(tiny_llama), dtype="float32", quantization=quantization)
        model = load_model(args.create_engine_config().model, torch.device("cpu"))
        down = model.model.layers[0].mlp.down_proj  # weight-only in both (int8: per row)
        kernel = down.quant_kernel
        assert kernel.packed.panels and kernel.packed.bits == bits
        assert down.weight.numel() == 0 and down.weight_packed is kernel.packed.qweight
        # one row of x as two int8 parts where the CPU runs int8 activations (rounded x alone
        # is for GGUF blocks only), more rows in fp32: either way fp32 x's result
        residual = weight_only.int8_activations_run(kernel.packed)
        assert kernel.x_form == ("int8_residual" if residual else "float")
        operands, levels = down.fused_operands()
        assert levels == -((128 if residual else 0) + bits) and operands[0].dim() == 3
        for rows in (1, 3):
            x = torch.randn(rows, down.in_features)
            want = x @ kernel.packed.dequantize().T
            torch.testing.assert_close(down(x), want, rtol=1e-4, atol=1e-4)
        if bits == 8:  # the checkpoint form comes back by rows
            assert torch.equal(kernel.weight_int8(), weight_only.by_rows(kernel.packed).qweight)
            assert kernel.weight_int8().shape == (down.out_features, down.in_features)


def test_a_loaded_models_cost_graph_counts_the_weights_in_panels(tiny_llama):
    from pagedllm.config import EngineArgs
    from pagedllm.models.loader import load_model
    from pagedllm.partition.graph import build_model_graph, graph_from_config

    config = EngineArgs(model=str(tiny_llama), dtype="float32").create_engine_config().model
    loaded = build_model_graph(load_model(config, torch.device("cpu")), config.hf_config,
                               "float32", "tiny")  # fmt: skip
    planned = graph_from_config(config.hf_config, "float32", "tiny")  # on the meta device
    fields = ("weight_bytes", "streamed_bytes", "flops_per_token", "flops_per_sample")
    for field in fields:
        assert [getattr(n, field) for n in loaded.nodes] == [
            getattr(n, field) for n in planned.nodes
        ]
    assert all(n.weight_bytes > 0 for n in loaded.nodes)

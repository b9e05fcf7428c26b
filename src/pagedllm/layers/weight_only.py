"""Weight-only int8 / int4 linear products with group-wise scales (csrc/weight_only_gemm.cpp).

A layer's weight W [N, K] is kept quantized in groups of ``group`` input features (a multiple
of 32 that divides K):

* int8: ``qweight`` int8 [N, K], ``scale`` [N, K / group]; W = scale * q (symmetric).
* int4: ``qweight`` uint8 [N, K / 2], ``scale`` and ``offset`` [N, K / group];
  W = scale * q + offset with q in [0, 15]. Codes are two per byte in blocks of 32 features:
  byte j of a block holds feature j (low nibble) and feature j + 16 (high nibble), GGUF's
  Q4_0 / Q4_1 order, so those files repack by copying bytes (:mod:`pagedllm.layers.gguf_repack`).

The constants are fp32 where pagedllm quantizes, fp16 where a GGUF file brings them: every
kernel reads either, so a file's weight keeps its bytes (at one row of x the product streams
them from memory, and fp32 constants made a Q4_1 file's layers 20% larger).

Activations stay in full precision (fp32, bf16 or fp16). A few rows (decode) run the C++
kernel, which unpacks each block in registers, so x is never rounded; many rows (prefill,
large decode batches) dequantize a slab of output rows at a time into a scratch tile (in C++:
straight into bf16 for a bf16 x where the CPU converts natively) and multiply it with BLAS in
x's dtype. No call ever holds a dequantized copy of the whole weight.

On an AVX-512 CPU a linear layer's weight is kept in panels of 16 output features instead
(:func:`in_panels`, installed by layers/quantization.py): one kernel of csrc/panel_gemm.cpp
runs every row count from it, up to 8 rows with the codes unpacked in registers (x exact in
fp32, the group constants applied once per block of 32; on AVX512-VNNI one row of x in int8
parts against the codes, :func:`linear`'s x_form), beyond with a slice of 4 panels at a
time dequantized into a cache-resident scratch for the float panel micro-kernel (bf16 for a
bf16 x, as the slab path does); an embedding in panels gathers each looked-up row from its
panel. Panels are stored four at a time, block by block (:func:`in_panels`), so that a
decode product reads its weight as three long streams. The row layout stays on other CPUs,
where the codes meet up to 4 rows of x on int8 with AVX2 (:func:`linear`'s x forms;
docs/architecture/quantization.md, "int8 activations by rows").
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.cpp_build import load_library
from pagedllm.layers import panel_gemm

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "weight_only_gemm.cpp"
ISAS = ("avx512", "avx2", "scalar")
BLOCK = 32  # features per packed block; group sizes are multiples of it
PANEL = panel_gemm.PANEL  # output features per panel (in_panels)
GROUP_PANELS = 4  # panels stored side by side, block by block (csrc/panel_gemm.cpp's kMaxNR)
# rows of x the C++ kernel unpacks the codes in registers for, the instruction set forced (tests):
# beyond, AVX2 runs slices of the weight through its own tile, the others dequantized slabs
KERNEL_MAX_ROWS = {"avx512": 16, "avx2": 8, "scalar": 16}
_SLAB_ELEMENTS = 1 << 20  # weights dequantized per slab on the many-row path (4 MiB fp32)


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the kernel; False if that fails."""
    what = "C++ weight-only GEMM kernel"
    fallback = "dequantizing weight slabs for every batch size"
    if load_library(_SOURCE, ["-O3", "-fopenmp"], "pagedllm_wo", what, fallback) is None:
        return False  # no compiler or ninja: the slab path still works
    logger.info("%s: %s", what, torch.ops.pagedllm_wo.isa())
    return True


def isa() -> str:
    """The instruction set the kernel runs on this CPU: avx512 | avx2 | scalar."""
    load()
    return torch.ops.pagedllm_wo.isa()


def cpu_runs(name: str) -> bool:
    load()
    return bool(torch.ops.pagedllm_wo.runs(name))


def group_size_for(in_features: int, requested: int) -> int | None:
    """The group size used for a layer with in_features inputs: the requested one if it
    divides them, else the largest smaller multiple of 32 that does; None if none does."""
    if requested % BLOCK or requested <= 0:
        raise ValueError(f"group_size must be a positive multiple of {BLOCK}, got {requested}.")
    for group in range(requested, 0, -BLOCK):
        if in_features % group == 0:
            return group
    return None


@dataclass
class PackedWeight:
    """A quantized weight in the kernel's layout (module docstring), by rows or in panels."""

    bits: int  # 8 or 4
    qweight: torch.Tensor  # int8 [N, K] | uint8 [N, K / 2]; panels: [N / 16, K (/ 2), 16]
    scale: torch.Tensor  # fp32 or fp16 [N, K / group]; panels: [N / 16, K / group, 16]
    offset: torch.Tensor | None  # like scale for int4, else None
    panels: bool = False  # the panel layout of :func:`in_panels`

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.qweight.shape[0], self.qweight.shape[1]
        return rows * (PANEL if self.panels else 1), cols * (2 if self.bits == 4 else 1)

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]  # scale [N, groups] or [N / 16, groups, 16]

    def nbytes(self) -> int:
        parts = [self.qweight, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """fp32 W[rows] (tests, the slab path, an embedding's lookups); rows a slice or ids.
        In panels each row is gathered from its panel by the C++ op."""
        if self.panels:
            ids = torch.arange(self.shape[0])[rows] if isinstance(rows, slice) else rows
            panel_gemm.load()
            return torch.ops.pagedllm_panel.quant_panel_rows(
                self.qweight, self.scale, self.offset, self.bits, ids.long()
            )
        codes, scale = self.qweight[rows], self.scale[rows]
        q = codes.float() if self.bits == 8 else unpack_int4(codes).float()
        w = q.view(q.shape[0], scale.shape[1], -1) * scale[..., None]
        if self.offset is not None:
            w = w + self.offset[rows][..., None]
        return w.view(q.shape[0], -1)


# ---- packing -------------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] -> [N, K / 2] bytes in the block order (docstring)."""
    rows, cols = codes.shape
    blocks = codes.to(torch.uint8).view(rows, cols // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes [N, K]."""
    rows, half = packed.shape
    blocks = packed.view(rows, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).view(rows, half * 2)


def _to_panels(t: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N / 16, C, 16]
    return t.reshape(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def _from_panels(t: torch.Tensor) -> torch.Tensor:  # [N / 16, C, 16] -> [N, C]
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()


def _steps_per_block(bits: int) -> int:
    """Steps of a panel (its C axis) per block of 32 input features: int4 codes hold two
    features a step, int8 one."""
    return BLOCK // 2 if bits == 4 else BLOCK


def _grouped(t: torch.Tensor, unit: int) -> torch.Tensor:
    """Panels [P, C, 16] (panel by panel) stored GROUP_PANELS at a time, ``unit`` steps by
    ``unit`` steps: the group's panels side by side at each block of 32 features (codes) or
    feature group (constants), then the next. The same shape; its storage order is
    csrc/panel_gemm.cpp's (Quant::block, Quant::constant), not the index's."""
    p, c, lanes = t.shape
    full = p // GROUP_PANELS * GROUP_PANELS
    head = t[:full].reshape(p // GROUP_PANELS, GROUP_PANELS, c // unit, unit, lanes)
    tail = t[full:].reshape(p - full, c // unit, unit, lanes)
    parts = [head.transpose(1, 2).reshape(-1), tail.transpose(0, 1).reshape(-1)]
    return torch.cat(parts).view(p, c, lanes)


def _ungrouped(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse of :func:`_grouped`: panels [P, C, 16] in index order."""
    p, c, lanes = t.shape
    full = p // GROUP_PANELS * GROUP_PANELS
    flat = t.reshape(-1)
    head = flat[: full * c * lanes].view(p // GROUP_PANELS, c // unit, GROUP_PANELS, unit, lanes)
    tail = flat[full * c * lanes :].view(c // unit, p - full, unit, lanes)
    return torch.cat([head.transpose(1, 2).reshape(full, c, lanes),
                      tail.transpose(0, 1).reshape(p - full, c, lanes)])  # fmt: skip


def in_panels(weight: PackedWeight) -> PackedWeight:
    """The same weight in panels of 16 output features (csrc/panel_gemm.cpp's quantized
    panels): int8 codes [N / 16, K, 16]; int4 [N / 16, K / 2, 16] with input features 2s and
    2s + 1 of the panel's outputs in the low and high nibbles of step s; scale and offset
    [N / 16, K / group, 16]. One kernel runs every row count from it. Each tensor is stored
    four panels at a time (:func:`_grouped`): block by block for the codes,
    feature group by feature group for the constants."""
    if weight.panels:
        return weight
    if weight.bits == 8:
        codes = _to_panels(weight.qweight)
    else:
        n, k = weight.shape
        pairs = unpack_int4(weight.qweight).view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3)
        codes = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    codes = _grouped(codes, _steps_per_block(weight.bits))
    offset = None if weight.offset is None else _grouped(_to_panels(weight.offset), 1)
    scale = _grouped(_to_panels(weight.scale), 1)
    return PackedWeight(weight.bits, codes, scale, offset, panels=True)


def by_rows(weight: PackedWeight) -> PackedWeight:
    """The inverse of :func:`in_panels` (tests, checkpoints, dequantizing)."""
    if not weight.panels:
        return weight
    panels = _ungrouped(weight.qweight, _steps_per_block(weight.bits))
    if weight.bits == 8:
        codes = _from_panels(panels)
    else:
        n, k = weight.shape
        pairs = torch.stack([panels & 0xF, panels >> 4], dim=-1)  # [P, K / 2, 16, 2]
        codes = pack_int4(pairs.permute(0, 2, 1, 3).reshape(n, k))
    offset = None if weight.offset is None else _from_panels(_ungrouped(weight.offset, 1))
    return PackedWeight(weight.bits, codes, _from_panels(_ungrouped(weight.scale, 1)), offset)


def panels_run(weight: PackedWeight) -> bool:
    """Whether this CPU runs ``weight`` in panels: AVX-512, whole panels of 16 outputs."""
    n, _ = weight.shape
    return (
        weight.qweight.device.type == "cpu" and n % PANEL == 0 and panel_gemm.quantized_available()
    )


def cpu_layout(weight: PackedWeight) -> PackedWeight:
    """The weight as this CPU runs it: in panels where panels_run, else by rows. Either way
    its constants stay as they are (a GGUF file's fp16, which both kernels read)."""
    return in_panels(weight) if panels_run(weight) else weight


def quantize(weight: torch.Tensor, bits: int, group: int) -> PackedWeight:
    """Round-to-nearest with one scale per group: int8 symmetric (|q| <= 127), int4 over each
    group's [min, max] (16 levels, the offset is the minimum)."""
    w = weight.detach().float()
    rows, cols = w.shape
    if cols % group or group % BLOCK:
        raise ValueError(f"group {group} must be a multiple of {BLOCK} dividing {cols}.")
    g = w.view(rows, cols // group, group)
    tiny = torch.finfo(torch.float32).tiny
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).clamp_min(tiny)
        q = (g / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        return PackedWeight(8, q.view(rows, cols).contiguous(), scale.contiguous(), None)
    if bits != 4:
        raise ValueError(f"bits must be 8 or 4, got {bits}.")
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp_min(tiny)
    q = ((g - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return PackedWeight(4, pack_int4(q.view(rows, cols)), scale.contiguous(), low.contiguous())


# ---- the product ---------------------------------------------------------------------------
def kernel_linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16) -> [M, N] in x's dtype through the C++ op: the weight
    unpacked in registers up to KERNEL_MAX_ROWS rows, beyond slices of it in fp32 through the
    op's own tile (AVX2) or dequantized slabs and ATen's GEMM. isa forces an instruction set
    the CPU runs (tests); "int8" / "int8_residual" put up to 4 / 2 rows of x on int8 (AVX2:
    :func:`linear`'s x forms); None takes the best."""
    if not load():
        raise RuntimeError("the C++ weight-only kernel could not be built on this machine")
    return torch.ops.pagedllm_wo.weight_only_linear(
        x, weight.qweight, weight.scale, weight.offset, weight.bits, bias, isa
    )


def slab_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Without the C++ op (another device, no compiler): dequantize a slab of output rows at a
    time and multiply it with the device's GEMM."""
    rows, cols = weight.shape
    step = max(16, _SLAB_ELEMENTS // cols)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, step):
        part = slice(start, min(rows, start + step))
        w = weight.dequantize(part).to(x.dtype)
        torch.matmul(x, w.t(), out=out[:, part])
    return out if bias is None else out.add_(bias)


def panel_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, isa: str | None = None
) -> torch.Tensor:
    """x [M, K] (fp32 / bf16) -> [M, N] in x's dtype with a weight in panels (csrc/
    panel_gemm.cpp): up to 8 rows the codes unpacked in registers, beyond a dequantized slice
    of a panel group at a time through the float micro-kernel. isa: as panel_gemm.linear."""
    return torch.ops.pagedllm_panel.quant_panel_linear(
        x.contiguous(), weight.qweight, weight.scale, weight.offset, weight.bits, bias, isa
    )


def int8_activations() -> bool:
    """Whether weight-only layers run on int8 activations on this CPU: in panels on
    AVX512-VNNI / VBMI (panel_gemm.int8_activations, its switch), else by rows on AVX2 (this
    module's kernel). PAGEDLLM_CPU_INT8_ACTIVATIONS=0 turns both off."""
    if panel_gemm.quantized_available():
        return panel_gemm.int8_activations()
    return (
        envs.PAGEDLLM_CPU_INT8_ACTIVATIONS()
        and load()
        and bool(torch.ops.pagedllm_wo.int8_activations())
    )


def int8_activations_run(weight: PackedWeight) -> bool:
    """Whether a layer that asks for int8 activations gets them here: codes in panels with
    panel_gemm's switch on, or codes by rows on a CPU where :func:`int8_activations`. Read
    when the layer is built."""
    if weight.panels:
        return panel_gemm.int8_activations()
    return weight.qweight.device.type == "cpu" and int8_activations()


# the isa argument of each x form: for codes in panels, for codes by rows
X_FORMS = {
    "float": None,
    "int8": "avx512_vnni",
    "int8_decode": "avx512_vnni_all",
    "int8_residual": "avx512_vnni_residual",
}
ROW_X_FORMS = {
    "float": None,
    "int8": "int8",
    "int8_decode": "int8",
    "int8_residual": "int8_residual",
}


def linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, x_form: str = "float"
) -> torch.Tensor:
    """x [M, K] W^T + bias with the quantized weight: the C++ op on a CPU (kernel_linear or,
    for a weight in panels, panel_linear). x_form (other than "float" only where
    int8_activations_run): "int8", up to 4 rows of x rounded to int8 per block of 32 (GGUF
    blocks, llama.cpp's numerics); "int8_decode", the rows of a decode step (one token of
    each sequence) so at any count in panels (csrc/panel_gemm.cpp's kVnniRows), as "int8" by
    rows; "int8_residual", each row as two int8 rows, x rounded and what the rounding left
    (fp32 x's accuracy at int8's cost: every other layer, an LM head too; in panels at one
    decoding sequence, by rows up to 2, where int8 codes take x on int16 instead: the same
    accuracy at half the multiplies); more rows as "float"."""
    if weight.panels:
        return panel_linear(x, weight, bias, X_FORMS[x_form])
    if x.device.type == "cpu" and load():
        return kernel_linear(x, weight, bias, ROW_X_FORMS[x_form])
    return slab_linear(x, weight, bias)

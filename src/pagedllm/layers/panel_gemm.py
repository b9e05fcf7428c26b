"""Float32 / bfloat16 weights stored in panels for the CPU (csrc/panel_gemm.cpp).

A linear weight W [N, K] becomes panels of 16 output features, [N / 16, K, 16] in float32 and
[N / 16, K / 2, 32] in bfloat16 (pairs of input features side by side, the operand of
AVX512-BF16's dot product). One micro-kernel then runs every row count from that one copy:
one row streams the weight at memory speed like the GEMV of fused_ops.cpp, and 2-64 rows
(decode batches) no longer pay for the blocked copy of the weight that BLAS makes on every
call with a plain one (half their time on this project's models, benchmarks/compare.py).

:func:`pack_model` converts a loaded model's float linear layers, token embedding and LM
head (a tied pair shares its panels: the embedding gathers its rows from them); where the CPU
has neither AVX-512F nor AVX2 with FMA, the shape does not split into panels, or
``PAGEDLLM_CPU_PANEL_WEIGHTS=0``, weights stay plain. On AVX2 the same panels run on 256-bit
vectors; weight-only codes in panels (:func:`quantized_available`) need AVX-512F.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from pagedllm import envs
from pagedllm.cpp_build import load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
PANEL = 16  # output features per panel
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load() -> bool:
    """Build (first call of the first process) and load the kernel; False if that fails."""
    name = load_library(
        _SOURCE, ["-O3", "-fopenmp"], "pagedllm_panel", "C++ panel GEMM", "plain weights"
    )
    if name is not None and not envs.PAGEDLLM_CPU_INT8_ACTIVATIONS():
        torch.ops.pagedllm_panel.int8_activations(0)
    return name is not None


@functools.cache
def available() -> bool:
    """Whether this CPU runs the kernel on float weights (AVX-512F, or AVX2 with FMA) and
    packing is not switched off."""
    return (
        envs.PAGEDLLM_CPU_PANEL_WEIGHTS() and load() and bool(torch.ops.pagedllm_panel.available())
    )


def isa() -> str:
    """amx_bf16 | avx512_bf16 | avx512 | avx2 | none: how the kernel multiplies on this CPU
    (amx_bf16: bfloat16 products of more than 6 rows on AMX tiles, fewer on AVX512-BF16;
    avx2: 256-bit vectors, bfloat16 widened to fp32)."""
    return torch.ops.pagedllm_panel.isa() if load() else "none"


def quantized_available() -> bool:
    """Whether weight-only int8 / int4 codes run in panels on this CPU (AVX-512F; on AVX2
    they keep layers/weight_only.py's layout by rows)."""
    return available() and isa() != "avx2"


def amx_blocks() -> int:
    """Blocks of 16 rows this process has multiplied on AMX tiles."""
    return torch.ops.pagedllm_panel.amx_blocks() if load() else 0


def row_blocks() -> int:
    """(Panel group, block of rows) items this process has multiplied: products of more than
    6 rows whose panel groups alone would not split evenly over the threads."""
    return torch.ops.pagedllm_panel.row_blocks() if load() else 0


def ahead_lines() -> int:
    """64-byte lines of weight that products of more than 6 rows (float panels) or 8 rows
    (quantized panels: their codes) have requested a panel group or slice ahead in this
    process: each row tile asks for its share of what comes next while it computes, so that
    the next group's first tile (or its dequantization) does not wait on memory."""
    return torch.ops.pagedllm_panel.ahead_lines() if load() else 0


def int8_rows() -> int:
    """Rows of x that quantized panel products have run on int8 activations in this process
    (a row taken as two int8 parts counts once): up to 4 a product, or a decode step's rows
    at any count (weight_only.linear's "int8_decode")."""
    return torch.ops.pagedllm_panel.int8_rows() if load() else 0


def packable(weight: torch.Tensor) -> bool:
    """A CPU float32 / bfloat16 [N, K] weight with N a multiple of 16 (and K even in bf16)."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPES or weight.dim() != 2:
        return False
    n, k = weight.shape
    return n > 0 and n % PANEL == 0 and k > 0 and (weight.dtype != torch.bfloat16 or k % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> its panels (a new tensor; see the module docstring for the layout)."""
    if not packable(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)}")
    load()  # the kernel that runs them
    n, k = weight.shape
    if weight.dtype == torch.float32:
        return weight.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    pairs = weight.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3)
    return pairs.reshape(n // PANEL, k // 2, 2 * PANEL).contiguous()


def unpack(panels: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight of panels made by :func:`pack`."""
    groups, steps, width = panels.shape
    if width == PANEL:  # float32
        return panels.transpose(1, 2).reshape(groups * PANEL, steps)
    pairs = panels.reshape(groups, steps, PANEL, 2).permute(0, 2, 1, 3)
    return pairs.reshape(groups * PANEL, steps * 2)


def rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [T] of the plain weight, [T, K]: an embedding lookup in panels (a C++
    gather; panels exist only where the kernel loaded, as for :func:`linear`)."""
    return torch.ops.pagedllm_panel.panel_rows(panels, ids.long())


def int8_activations_available() -> bool:
    """Whether this CPU runs weight-only panels on int8 activations (AVX512-VNNI and VBMI)."""
    return load() and bool(torch.ops.pagedllm_panel.vnni())


def int8_activations(enable: bool | None = None) -> bool:
    """Whether weight-only layers in panels multiply x on AVX512-VNNI
    (weight_only.int8_activations_run; quantization.x_form picks the form): a GGUF file's
    layers up to 4 rows of x rounded to int8 per block of 32, as llama.cpp's quantized dot
    products do, every other one (an LM head too) one row as two int8 parts with fp32 x's
    accuracy. Default on where the CPU has it; PAGEDLLM_CPU_INT8_ACTIVATIONS=0 starts it off
    (x in fp32 throughout); ``enable`` sets it for the process first, for layers built
    afterwards. False where the kernel did not load."""
    if not load():
        return False
    return bool(torch.ops.pagedllm_panel.int8_activations(-1 if enable is None else int(enable)))


def linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    isa: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] W^T + bias with W in panels; x of the panels' dtype. isa: avx512 runs
    bfloat16 without AVX512-BF16's dot product, avx2 on 256-bit vectors (default: the best
    this CPU has; a CPU runs its own and those before it in that order). out_dtype
    float32 for bfloat16 x: the bfloat16 results widened, as ``.float()`` of them (logits)."""
    k = panels.shape[1] * panels.shape[2] // PANEL
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    y = torch.ops.pagedllm_panel.panel_linear(flat, panels, bias, isa, out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def pack_layers(modules: Iterable[nn.Module]) -> int:
    """Keep these layers' weights in panels from now on (each layer's ``weight_panels``;
    ``weight`` becomes empty, keeping the name and dtype); a weight shared by several (tied
    embeddings) is packed once and stays shared. Returns the number of weights packed."""
    shared: dict[int, list[nn.Module]] = {}
    for module in modules:
        shared.setdefault(id(module.weight), []).append(module)
    for group in shared.values():
        weight = group[0].weight
        panels = pack(weight.data)
        empty = nn.Parameter(weight.new_empty(0), requires_grad=False)
        empty.weight_loader = getattr(weight, "weight_loader", None)
        for module in group:
            module.weight, module.weight_panels = empty, panels
    return len(shared)


def unpack_layers(modules: Iterable[nn.Module]) -> None:
    """Back to plain weights (what a quantization pass reads and rewrites); layers sharing
    panels share one plain weight again."""
    plain: dict[int, nn.Parameter] = {}
    for module in modules:
        panels = getattr(module, "weight_panels", None)
        if panels is None:
            continue
        if id(panels) not in plain:
            weight = nn.Parameter(unpack(panels).contiguous(), requires_grad=False)
            weight.weight_loader = module.weight.weight_loader
            plain[id(panels)] = weight
        module.weight, module.weight_panels = plain[id(panels)], None


def pack_model(model: nn.Module) -> int:
    """Pack every layer of a loaded CPU model that says it packs (``packs_into_panels()``:
    float linear layers, the embedding and LM head, on a weight that splits into panels);
    returns how many weights. A no-op where the kernel is unavailable."""
    layers = [m for m in model.modules()
              if hasattr(m, "packs_into_panels") and m.packs_into_panels()]  # fmt: skip
    if not layers or not available():
        return 0
    count = pack_layers(layers)
    logger.info("%d weights in panels (%s)", count, isa())
    return count

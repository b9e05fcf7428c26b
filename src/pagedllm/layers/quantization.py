"""int8 dynamic quantization: int8 weights with per-row scales, activations quantized per token.

``DynamicQuantConfig(...).apply(model, exclude_layers=[...])`` rewrites a loaded model in place.
Every linear layer (``LinearBase``), the LM head and the token embedding that no pattern
excludes gets

* ``weight``: int8 [rows, cols] and ``weight_scale``: fp32 [rows], symmetric, so that
  ``w ~= weight * weight_scale[:, None]``. Per-tensor scales are stored per row too (all equal),
  so scales shard exactly like the rows under tensor parallelism. Both parameters keep the
  layer's ``weight_loader``: a saved int8 checkpoint loads, sharded, through the usual path.
* its int8 layer class (``Int8ColumnParallelLinear`` ...), which keeps the float layer's
  sharding and collectives and replaces only the product: ``matmul`` of a linear layer and
  ``local_logits`` of the LM head run the layer's int8 kernel, ``lookup`` of the embedding
  dequantizes the rows it reads. With activations enabled, each token's row is scaled by its
  own absolute maximum (the observer), rounded to int8, multiplied in int8 with int32
  accumulation, and rescaled by ``token_scale x weight_scale``. Without, the int8 weight is
  dequantized inside the matmul.

Quantization works on each rank's local shard after loading, so it composes with tensor
parallelism: column-parallel layers get exactly their rows' scales; row-parallel layers scale
their own slice of the input features.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import decoding_step
from pagedllm.config import QuantConfig
from pagedllm.cpu_info import cpu_flags
from pagedllm.layers import cpu_int8, panel_gemm, weight_only
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

logger = logging.getLogger(__name__)

QMAX = 127  # symmetric int8: [-127, 127], so that -x quantizes to -q
_TINY = torch.finfo(torch.float32).tiny


def quantize_symmetric(
    x: torch.Tensor, absmax: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of x [rows, cols] by each row's range absmax [rows, 1]: the
    integers (still floating point) in [-levels, levels] and the step [rows, 1] they are
    multiplied by. An all-zero row gets the smallest step and quantizes to zeros."""
    step = (absmax / levels).clamp_min(_TINY)
    return (x / step).round_().clamp_(-levels, levels), step


def quantize_weight(
    weight: torch.Tensor, granularity: str = "per_channel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a [rows, cols] weight: (q int8 [rows, cols], scale fp32 [rows])."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    if granularity == "per_tensor":
        absmax = absmax.amax().expand_as(absmax)
    q, scale = quantize_symmetric(w, absmax, QMAX)
    return q.to(torch.int8), scale[:, 0].contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


# ---- observers: the range of each token's activations ----------------------------------------
class MinMaxObserver:
    """Per token: each row's own absolute maximum. Stateless, so a token's result never depends
    on the rest of the batch (a prefix-cache hit reproduces the recomputed values)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, 1] fp32
        return x.abs().amax(dim=1, keepdim=True).float()


class MovingAverageObserver:
    """torch.ao's MovingAverageMinMaxObserver made symmetric: one range for all tokens, an
    exponential moving average of each batch's absolute maximum (values beyond it saturate).

    Calibrated (:meth:`calibrate`, which ``apply`` runs over its calibration windows), the
    range is fixed: a static activation scale, so a token's result never depends on the
    batches served. Uncalibrated, it keeps averaging the batches it sees: then greedy output
    is not batch-invariant."""

    def __init__(self, device: torch.device, averaging_constant: float = 0.01) -> None:
        self.absmax = torch.zeros((), device=device)
        self.averaging_constant = averaging_constant
        self.calibrated = False

    def update(self, current: torch.Tensor) -> None:
        # The first batch (absmax still 0) sets the range; no host sync either way.
        blended = self.absmax + self.averaging_constant * (current - self.absmax)
        self.absmax.copy_(torch.where(self.absmax == 0, current, blended))

    def calibrate(self, batch_absmax: Iterable[torch.Tensor]) -> None:
        """Average the ranges of calibration batches and freeze the result."""
        for current in batch_absmax:
            self.update(current.float().to(self.absmax.device))
        self.calibrated = bool(self.absmax > 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calibrated:
            self.update(x.abs().amax().float())
        return self.absmax.expand(x.shape[0], 1)


OBSERVERS: dict[str, Callable[..., Callable[[torch.Tensor], torch.Tensor]]] = {
    "minmax": lambda device: MinMaxObserver(),
    "moving_average": lambda device: MovingAverageObserver(device),
}


# ---- kernels: matmul(x, bias) of a layer whose weight is int8 --------------------------------
class Int8Kernel:
    """x [..., K] -> x W^T + bias [..., N] in x's dtype; subclasses say how the product runs."""

    name = ""
    levels = QMAX  # activations are rounded to [-levels, levels]

    def __init__(
        self, module: nn.Module, observer: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> None:
        self.qweight: torch.Tensor = module.weight  # int8 [N, K]
        self.scale: torch.Tensor = module.weight_scale  # fp32 [N]
        self.observer = observer

    def mm(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N], any float dtype
        raise NotImplementedError

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token int8 (as float, rounded and clamped) and each token's scale [M, 1]."""
        assert self.observer is not None
        return quantize_symmetric(x, self.observer(x), self.levels)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0]:
            y = self.mm(flat).to(x.dtype)
        else:
            y = flat.new_empty(0, self.scale.shape[0])
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def weight_int8(self) -> torch.Tensor:
        """The int8 weight [N, K] as stored in a checkpoint (tests and saving)."""
        return self.qweight

    def fused_operands(
        self, bias: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], int] | None:
        """What the fused CPU decoder layers take for this product; None: they cannot run it."""
        return None


@functools.cache
def _cpu_has_vnni() -> bool:
    """Whether the CPU multiplies u8 x s8 straight into int32 (AVX-512 VNNI, AVX-VNNI, AMX)."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


class OneDNNKernel(Int8Kernel):
    """CPU: oneDNN's u8 x s8 GEMM with int32 accumulation. The weight is prepacked once and the
    plain int8 copy dropped.

    Without VNNI, x86 multiplies u8 x s8 pairs into saturating int16 (vpmaddubsw): two products
    of 255 x 127 overflow it. Activations then keep 7 bits (|q| <= 63, so u8 <= 127), as
    fbgemm's reduce_range does, and the int32 result is exact."""

    name = "onednn"

    def __init__(self, module: nn.Module, observer: Callable | None) -> None:
        super().__init__(module, observer)
        self.levels = QMAX if _cpu_has_vnni() else 63
        self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)  # [K, N] blocked
        self.zero_points = torch.zeros(self.scale.shape[0], dtype=torch.long)
        del self.qweight

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, step = self.quantize_input(x)
        zero = self.levels + 1  # uint8 with this zero point holds [-levels, levels] exactly
        xu = xq.add_(zero).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            xu, 1.0, zero, self.packed, self.scale, self.zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return y.mul_(step)  # [M, N] = sum(xq * wq) * weight_scale * token_step

    def weight_int8(self) -> torch.Tensor:
        return self.packed.to_dense().t()


class CpuInt8Kernel(Int8Kernel):
    """CPU: pagedllm's C++ int8 GEMM (layers/cpu_int8.py): the observer, rounding, u8 x s8
    product with exact int32 sums and the rescale in one call per layer. Same integers and
    scales as OneDNNKernel (and the same 7-bit activations without VNNI); at decode sizes it
    saves the per-layer torch ops that cost more than the product (3x at one row), at 256
    rows it is within a few percent of oneDNN (benchmarks/gemm_int8.py). Per-token observer
    only: the kernel measures each row's range itself."""

    name = "cpu_int8"

    def __init__(self, module: nn.Module, observer: Callable | None) -> None:
        super().__init__(module, observer)
        if not isinstance(observer, MinMaxObserver):
            raise ValueError("the cpu_int8 kernel needs the per-token (minmax) observer.")
        if not cpu_int8.load():
            raise RuntimeError("the C++ int8 kernel could not be built on this machine")
        self.levels = QMAX if _cpu_has_vnni() and cpu_int8.has_vnni() else 63
        self.packed, self.rowsum = cpu_int8.pack(self.qweight)
        self.shape = tuple(self.qweight.shape)
        del self.qweight

    def mm(self, x: torch.Tensor) -> torch.Tensor:  # bf16 x in, bf16 y out: no conversions
        x = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        return cpu_int8.linear(x, self.packed, self.rowsum, self.scale, self.levels)

    def fused_operands(self, bias: torch.Tensor | None) -> tuple[list[torch.Tensor | None], int]:
        return [self.packed, self.rowsum, self.scale, bias], self.levels

    def weight_int8(self) -> torch.Tensor:
        return cpu_int8.unpack(self.packed, self.shape)


class IntMMKernel(Int8Kernel):
    """torch._int_mm (int8 x int8 -> int32): cuBLASLt on CUDA, a reference loop elsewhere."""

    name = "int_mm"

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, step = self.quantize_input(x)
        rows = xq.shape[0]
        if x.is_cuda and rows <= 16:  # cuBLASLt's int8 GEMM needs more than 16 rows
            xq = F.pad(xq, (0, 0, 0, 17 - rows))
        acc = torch._int_mm(xq.to(torch.int8), self.qweight.t())[:rows]  # int32 [M, N]
        return acc.float().mul_(step).mul_(self.scale)


class WeightOnlyKernel(Int8Kernel):
    """Weight-only int8: activations stay in full precision. On CPU the C++ kernel of
    layers/weight_only.py unpacks the int8 rows in registers (the per-row scale is one group
    spanning the row); where it cannot run, the int8 weight is dequantized inside the matmul."""

    name = "weight_only"

    def __init__(self, module: nn.Module, observer: Callable | None) -> None:
        super().__init__(module, observer)
        rows, cols = self.qweight.shape
        self.packed: weight_only.PackedWeight | None = None
        if self.qweight.device.type == "cpu" and cols % weight_only.BLOCK == 0:
            self.packed = weight_only.PackedWeight(8, self.qweight, self.scale.view(rows, 1), None)
            if weight_only.panels_run(self.packed):  # the codes move; _to_int8_class drops these
                self.packed = weight_only.in_panels(self.packed)
        self.x_form = "float" if self.packed is None else x_form(module, self.packed)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return weight_only.linear(x, self.packed, None, self.x_form)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale.to(x.dtype))
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)

    def weight_int8(self) -> torch.Tensor:
        if self.packed is not None and self.packed.panels:
            return weight_only.by_rows(self.packed).qweight
        return self.qweight

    def fused_operands(
        self, bias: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], int] | None:
        return _weight_only_operands(self.packed, bias, self.x_form)


class GroupKernel(Int8Kernel):
    """Weight-only int4 (or group-wise int8) of layers/weight_only.py: the module's weight
    is a PackedWeight (``weight_packed`` codes, ``weight_group_scale`` / ``_offset``)."""

    name = "weight_only_group"

    def __init__(
        self, module: nn.Module, packed: weight_only.PackedWeight, int8_x: bool = False
    ) -> None:
        self.packed = packed
        self.scale = packed.scale.new_empty(packed.shape[0])  # its length: the output features
        self.observer = None
        self.x_form = x_form(module, packed, int8_x)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        form = self.x_form
        if form == "int8" and decoding_step():  # a decode step's rows: int8 at any count
            form = "int8_decode"
        return weight_only.linear(x, self.packed, None, form)

    def weight_int8(self) -> torch.Tensor:
        raise TypeError("a group-quantized weight has no per-row int8 form")

    def fused_operands(
        self, bias: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], int] | None:
        return _weight_only_operands(self.packed, bias, self.x_form)


def x_form(module: nn.Module, packed: weight_only.PackedWeight, int8_x: bool = False) -> str:
    """How a weight-only layer's x meets its codes (weight_only.linear), where the CPU runs
    int8 activations: a layer asking for int8_x (GGUF blocks, llama.cpp's numerics, never an
    LM head) "int8" (in a decode step "int8_decode", GroupKernel.mm); every other layer
    "int8_residual", x as two int8 parts (x rounded per block of 32, then what the rounding
    left), off by at most 1.6e-5 times the block's largest |x| where an int8 weight's own
    rounding is 3.9e-3 times its row's largest: the accuracy of fp32 x at the cost of int8
    products (one int8 part turned SmolLM2 Q4_1's "Paris" into French babble as its LM head,
    tests/models/test_real_model_gguf.py); by rows, int8 codes take x on int16 per block
    instead (off by at most 1.5e-5 times the block's largest |x|, half the multiplies). Where
    the CPU runs neither (weight_only.int8_activations_run: panels on AVX512-VNNI, codes by
    rows on AVX2), "float"."""
    if not weight_only.int8_activations_run(packed):
        return "float"
    if int8_x and not isinstance(module, ParallelLMHead):
        return "int8"
    return "int8_residual"


# fused_ops.cpp's activation levels of a weight-only product: -(form * 64 + bits)
_X_FORM_LEVELS = {"float": 0, "int8": 64, "int8_residual": 128}


def _weight_only_operands(
    packed: weight_only.PackedWeight | None, bias: torch.Tensor | None, form: str
) -> tuple[list[torch.Tensor | None], int] | None:
    """The fused decoder's form of a weight-only product (csrc/fused_ops.cpp): codes, int4
    offsets, group scales, bias, and the activation level -(f + bits), f 0 for float x, 64
    where x is rounded to int8, 128 where it is two int8 parts (the x_form)."""
    if packed is None or packed.qweight.device.type != "cpu" or not weight_only.load():
        return None
    return [packed.qweight, packed.offset, packed.scale, bias], -(
        _X_FORM_LEVELS[form] + packed.bits
    )


KERNELS: dict[str, type[Int8Kernel]] = {
    k.name: k for k in (CpuInt8Kernel, OneDNNKernel, IntMMKernel, WeightOnlyKernel)
}


def default_kernel(
    device: torch.device, enable_activation: bool, observer_type: str = "minmax"
) -> str:
    """The fastest kernel the device has for the requested mode."""
    if not enable_activation:
        return "weight_only"
    if device.type == "cpu" and observer_type == "minmax" and cpu_int8.load():
        return "cpu_int8"
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "int_mm"


def _kernel_for(
    module: nn.Module, requested: str | None, enable_activation: bool, observer_type: str
) -> str:
    name = requested or default_kernel(module.weight.device, enable_activation, observer_type)
    rows, cols = module.weight.shape
    if name == "int_mm" and module.weight.is_cuda and (rows % 8 or cols % 8):
        return "weight_only"  # cuBLASLt's int8 GEMM needs K and N multiples of 8
    return name


# ---- int8 layer classes: the float layer's sharding and collectives, an int8 product -------
class _Int8Matmul:
    """The one method an int8 linear layer replaces: x W^T + bias through its int8 kernel.
    Listed first in each int8 class's bases, so the float layer's forward (and the
    row-parallel reduction) runs around it unchanged."""

    quant_kernel: Int8Kernel

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_kernel(x, bias)

    def fused_operands(self) -> tuple[list[torch.Tensor | None], int] | None:
        if self.comm.world_size != 1:  # type: ignore[attr-defined]
            return None
        return self.quant_kernel.fused_operands(self.bias)  # type: ignore[attr-defined]


class Int8ReplicatedLinear(_Int8Matmul, ReplicatedLinear):
    pass


class Int8ColumnParallelLinear(_Int8Matmul, ColumnParallelLinear):
    pass


class Int8MergedColumnParallelLinear(_Int8Matmul, MergedColumnParallelLinear):
    pass


class Int8QKVParallelLinear(_Int8Matmul, QKVParallelLinear):
    pass


class Int8RowParallelLinear(_Int8Matmul, RowParallelLinear):
    pass


class Int8ParallelLMHead(ParallelLMHead):
    quant_kernel: Int8Kernel

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_kernel(hidden, None)  # [n, local vocab rows]

    def fused_operands(self) -> tuple[list[torch.Tensor | None], int] | None:
        if self.comm.world_size != 1:
            return None
        return self.quant_kernel.fused_operands(None)


class Int8VocabParallelEmbedding(VocabParallelEmbedding):
    """Rows are dequantized as they are looked up (an embedding has no matmul)."""

    quant_kernel: None
    dequant_dtype: torch.dtype  # the dtype the float layer's outputs had

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(local_ids, self.weight).float() * self.weight_scale[local_ids, None]
        return rows.to(self.dequant_dtype)

    def fused_lookup(self) -> tuple[int, list[torch.Tensor | None], int] | None:
        if self.comm.world_size != 1:
            return None
        return 3, [self.weight, None, self.weight_scale], 0


class PackedVocabParallelEmbedding(VocabParallelEmbedding):
    """A group-quantized embedding (a GGUF file's Q8_0 token embedding): the rows looked up
    are dequantized, the rest stays in codes."""

    packed: weight_only.PackedWeight
    dequant_dtype: torch.dtype

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        return self.packed.dequantize(local_ids).to(self.dequant_dtype)

    def fused_lookup(self) -> tuple[int, list[torch.Tensor | None], int] | None:
        packed = self.packed
        if self.comm.world_size != 1 or not packed.panels:
            return None
        return 2, [packed.qweight, packed.offset, packed.scale], packed.bits


INT8_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    ReplicatedLinear: Int8ReplicatedLinear,
    ColumnParallelLinear: Int8ColumnParallelLinear,
    MergedColumnParallelLinear: Int8MergedColumnParallelLinear,
    QKVParallelLinear: Int8QKVParallelLinear,
    RowParallelLinear: Int8RowParallelLinear,
    ParallelLMHead: Int8ParallelLMHead,
    VocabParallelEmbedding: Int8VocabParallelEmbedding,
}
QUANTIZABLE = tuple(INT8_CLASSES)


def _to_int8_class(module: nn.Module, kernel: Int8Kernel | None) -> None:
    """Turn a float layer whose weight is int8 now into its int8 class, in place (parameters,
    weight loaders and ties stay as they are)."""
    module.__class__ = INT8_CLASSES[type(module)]
    module.quant_kernel = kernel
    if isinstance(kernel, (OneDNNKernel, CpuInt8Kernel)):
        # The prepacked copy replaces the plain int8 weight; an empty one keeps the name.
        module.register_buffer("weight_packed", kernel.packed, persistent=False)
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    elif (
        isinstance(kernel, WeightOnlyKernel) and kernel.packed is not None and kernel.packed.panels
    ):
        module.register_buffer("weight_packed", kernel.packed.qweight, persistent=False)
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        kernel.qweight = module.weight


def install_packed(
    module: nn.Module, packed: weight_only.PackedWeight, int8_x: bool = False
) -> None:
    """Make a float linear layer (or LM head) run on a group-quantized weight: int4 / int8
    codes in layers/weight_only.py's layout, from quantizing it or from a GGUF file's blocks
    (layers/gguf_repack.py). The float weight is dropped; an empty one keeps the name.
    int8_x: the layer rounds up to 4 rows of x to int8 per block of 32 on AVX512-VNNI, as
    llama.cpp does for GGUF blocks; never an LM head (x_form)."""
    if not isinstance(module, (LinearBase, VocabParallelEmbedding)):
        raise TypeError(f"{type(module).__name__} cannot run on packed weights")
    rows, cols = packed.shape
    if tuple(module.weight.shape) != (rows, cols):
        raise ValueError(f"packed weight {rows}x{cols} != layer {tuple(module.weight.shape)}")
    module.dequant_dtype = module.weight.dtype
    packed = weight_only.cpu_layout(packed)  # (a no-op on a weight laid out already)
    module.register_buffer("weight_packed", packed.qweight, persistent=False)
    module.register_buffer("weight_group_scale", packed.scale, persistent=False)
    if packed.offset is not None:
        module.register_buffer("weight_group_offset", packed.offset, persistent=False)
    module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    module.quant_method = f"int{packed.bits} weight-only, group {packed.group}"
    if type(module) is VocabParallelEmbedding:
        module.__class__ = PackedVocabParallelEmbedding
        module.packed = packed
        return
    _to_int8_class(module, GroupKernel(module, packed, int8_x))


# ---- the config and its passes ---------------------------------------------------------------
def _excluded(name: str, patterns: Iterable[str]) -> bool:
    """A module name matches a pattern exactly, as an fnmatch glob, or as a dotted suffix
    ("lm_head", "o_proj", "model.layers.0.*", "*.self_attn.*")."""
    return any(
        name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns
    )


def _int8_param(data: torch.Tensor, loader: Callable) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    return param


def _replace_weights(
    modules: Iterable[nn.Module], make: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Swap each module's weight for int8 ``weight`` + ``weight_scale`` made by make(weight);
    a weight shared by two modules (tied embeddings) is converted once and stays shared."""
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in modules:
        old = module.weight
        if id(old) not in done:
            q, scale = make(old)
            loader = old.weight_loader
            done[id(old)] = (_int8_param(q, loader), _int8_param(scale, loader))
        module.dequant_dtype = old.dtype  # the dtype the module's outputs keep
        module.weight, module.weight_scale = done[id(old)]


def _empty_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders of a pre-quantized checkpoint's tensors, filled by the weight loaders."""
    return (
        torch.empty(weight.shape, dtype=torch.int8, device=weight.device),
        torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device),
    )


# Defaults measured on SmolLM2-135M-Instruct (benchmarks/quant.py sensitivity: top-1
# agreement with fp32 over pydoc text, fake-quantizing one kind of layer at a time): per-token
# int8 inputs cost the most agreement at down_proj, whose inputs (silu(gate) * up) carry the
# largest outliers, so it takes int8 weights with full-precision inputs, as the LM head does
# (docs/architecture/quantization.md: quantize-eval with and without the head in int8).
DEFAULT_WEIGHT_ONLY_LAYERS: tuple[str, ...] = ("*.mlp.down_proj",)
DEFAULT_SMOOTHQUANT_ALPHA = 0.5
EMBEDDING_CLASSES = (ParallelLMHead, VocabParallelEmbedding)
CALIBRATION_TOKENS = 1024  # tokens of the calibration pass (windows of CALIBRATION_WINDOW)
CALIBRATION_WINDOW = 256


def calibration_windows(ids: list[int], tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """Token windows for :meth:`DynamicQuantConfig.apply` from a token stream."""
    ids = ids[:tokens]
    return [ids[i : i + CALIBRATION_WINDOW] for i in range(0, len(ids), CALIBRATION_WINDOW)]


def calibration_text() -> str:
    """Text that ships with Python (pydoc's topics), taken from the half of its topics that
    ``pagedllm quantize-eval`` does not score by default."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)[0::2])


def weights_changed(model: nn.Module) -> None:
    """Tell whoever runs ``model`` that its linear layers were replaced: an engine's runner
    installs its ``rebuild_fast_path`` as ``model.on_weights_changed``, so quantizing a model
    that already ran (``apply(model=engine.model)``) also changes what the next step runs."""
    callback = getattr(model, "on_weights_changed", None)
    if callback is not None:
        callback()


@dataclass(frozen=True)
class DynamicQuantConfig(QuantConfig):
    """int8 / int4 quantization of a model's linear layers (module docstring).

    With the defaults (quant_dtype int8) the LM head and ``weight_only_layers`` (default
    DEFAULT_WEIGHT_ONLY_LAYERS) get int8 weights with full-precision inputs, the embedding int8
    rows (quantize_embeddings=False keeps both in full precision), the rest int8 x int8
    products; given calibration windows, the
    activation outliers of the int8 x int8 layers are first folded into their weights
    (SmoothQuant, smoothquant_alpha) and a moving_average observer is calibrated into a
    static scale. quant_dtype int4: every target linear layer weight-only int4
    (round-to-nearest, one scale and offset per group_size inputs; 32 by default, GGUF Q4_1's
    grid: on SmolLM2, whose weights come from a Q4_1 file, groups of 64 / 128 cost 0.27 / 0.38
    nats of KL per token where 32 reproduces the weights exactly), and the LM head and
    embedding int8 rows as with int8 (quantize_embeddings=False keeps them).

    kernel: one of KERNELS, or None for the fastest the device has (on CPU the C++ cpu_int8
    kernel with the minmax observer, else oneDNN; _int_mm on CUDA; weight-only when
    enable_activation is False).
    """

    kernel: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel is not None and self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {self.kernel!r}.")
        if self.group_size <= 0 or self.group_size % weight_only.BLOCK:
            raise ValueError(f"group_size must be a multiple of 32, got {self.group_size}.")
        alpha = self.smoothquant_alpha
        if alpha is not None and not 0.0 <= alpha < 1.0:
            raise ValueError(f"smoothquant_alpha must be in [0, 1), got {alpha}.")
        if self.quant_dtype == "int4" and self.prequantized:
            raise ValueError("int4 is quantized at load time; prequantized checkpoints are int8.")

    @classmethod
    def from_config(cls, config: QuantConfig) -> DynamicQuantConfig:
        return cls(**dataclasses.asdict(config))

    @property
    def weight_only_patterns(self) -> tuple[str, ...]:
        if self.weight_only_layers is None:
            return DEFAULT_WEIGHT_ONLY_LAYERS
        return tuple(self.weight_only_layers)

    @property
    def embeddings(self) -> bool:
        """Whether the LM head and token embedding are quantized (to int8 rows, with int8 and
        int4 alike; by default)."""
        return self.quantize_embeddings is not False

    @property
    def alpha(self) -> float:
        return (
            DEFAULT_SMOOTHQUANT_ALPHA if self.smoothquant_alpha is None else self.smoothquant_alpha
        )

    def targets(
        self, model: nn.Module, exclude_layers: Iterable[str] | None = None
    ) -> dict[str, nn.Module]:
        """Modules to quantize: linear layers (and, with quantize_embeddings, the LM head and
        embedding) not excluded nor done."""
        patterns = tuple(self.exclude_layers if exclude_layers is None else exclude_layers)
        candidates = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, QUANTIZABLE) and not hasattr(m, "quant_kernel")
        }
        for p in patterns:
            if not any(_excluded(name, [p]) for name in candidates):
                logger.warning("quantization exclude pattern %r matches no layer", p)

        def kept(name: str, m: nn.Module) -> bool:
            if _excluded(name, patterns):
                return True
            return isinstance(m, EMBEDDING_CLASSES) and not self.embeddings

        # A weight shared with a module kept (tied embeddings) stays as it is too.
        kept_weights = {id(m.weight) for n, m in candidates.items() if kept(n, m)}
        return {
            n: m
            for n, m in candidates.items()
            if not kept(n, m) and id(m.weight) not in kept_weights
        }

    def is_weight_only(self, name: str) -> bool:
        return not self.enable_activation or _excluded(name, self.weight_only_patterns)

    def apply(
        self,
        model: nn.Module,
        exclude_layers: Iterable[str] | None = None,
        calibration: list[list[int]] | None = None,
    ) -> list[str]:
        """Quantize a loaded model in place; returns the names of the modules quantized.

        exclude_layers (module names or patterns, see _excluded) default to the config's.
        calibration: token windows (:func:`calibration_windows`) for SmoothQuant and the
        moving_average observer's static scale; None: those of the model's tokenizer folder
        when the loader recorded one (``calibration_folder``, so that quantizing an engine's
        model equals quantizing at load), else no smoothing, and a moving_average observer
        keeps following the batches it sees.
        """
        targets = self.targets(model, exclude_layers)
        panel_gemm.unpack_layers(targets.values())  # the passes below rewrite plain weights
        if calibration is None and getattr(model, "calibration_folder", None):
            calibration = calibration_for_folder(model.calibration_folder)
        if self.quant_dtype == "int4":
            # The LM head and embedding take int8's rows (the head weight-only): left in full
            # precision, SmolLM2's tied 28M-weight embedding was 113 MB of its int4 model's
            # 193, all of it read every decode step.
            embeddings = {n: m for n, m in targets.items() if isinstance(m, EMBEDDING_CLASSES)}
            for name, module in targets.items():
                if name not in embeddings:
                    self._pack_int4(name, module)
            _replace_weights(embeddings.values(), lambda w: quantize_weight(w, self.granularity))
            self._bind(embeddings, {})
        else:
            ranges = self._calibrate(model, targets, calibration)
            _replace_weights(targets.values(), lambda w: quantize_weight(w, self.granularity))
            self._bind(targets, ranges)
        if targets:
            weights_changed(model)
        return list(targets)

    def _pack_int4(self, name: str, module: nn.Module) -> None:
        group = weight_only.group_size_for(module.weight.shape[1], self.group_size)
        if group is None:
            raise ValueError(
                f"int4 needs input features in multiples of 32; {name} has "
                f"{module.weight.shape[1]} (exclude it with exclude_layers)"
            )
        install_packed(module, weight_only.quantize(module.weight, 4, group))

    def _calibrate(
        self,
        model: nn.Module,
        targets: dict[str, nn.Module],
        calibration: list[list[int]] | None,
    ) -> dict[str, list[torch.Tensor]]:
        """SmoothQuant folds and the activation ranges of the int8 x int8 layers."""
        active = {
            n: m
            for n, m in targets.items()
            if isinstance(m, LinearBase) and not self.is_weight_only(n)
        }
        wants_ranges = self.alpha > 0 or self.observer_type == "moving_average"
        if not calibration or not active or not wants_ranges:
            return {}
        if any(m.comm.world_size != 1 for m in active.values()):
            # Each rank holds a shard: smoothing factors from shard-local weight ranges would
            # divide the replicated norms differently per rank.
            logger.warning("tensor parallel: int8 runs without its calibration pass")
            return {}
        from pagedllm.layers import calibration as calib

        ranges = calib.collect_ranges(model, active, calibration)
        if self.alpha > 0:
            calib.smooth(model, ranges, self.alpha, set(active), set(targets))
        return ranges

    def prepare_checkpoint(self, model: nn.Module) -> None:
        """Before loading a pre-quantized checkpoint: int8 parameters for it to fill."""
        if self.prequantized:
            _replace_weights(self.targets(model).values(), _empty_int8)

    def finish_loading(
        self, model: nn.Module, calibration: list[list[int]] | None = None
    ) -> list[str]:
        """After loading: quantize the full-precision weights, or bind the loaded int8 ones."""
        if not self.prequantized:
            return self.apply(model, calibration=calibration)
        targets = self.targets(model)
        self._bind(targets, {})
        return list(targets)

    def _bind(self, targets: dict[str, nn.Module], ranges: dict[str, list[torch.Tensor]]) -> None:
        """Install the int8 matmul / forward of each module whose weight is int8 now."""
        for name, module in targets.items():
            kernel = None
            if isinstance(module, (LinearBase, ParallelLMHead)):
                # The logits pick the token: int8 inputs there cost SmolLM2 its answers.
                weight_only_layer = self.is_weight_only(name) or isinstance(module, ParallelLMHead)
                kernel_name = _kernel_for(
                    module, None if weight_only_layer else self.kernel,
                    not weight_only_layer, self.observer_type,
                )  # fmt: skip
                observer = None
                if not weight_only_layer:
                    observer = OBSERVERS[self.observer_type](module.weight.device)
                    if isinstance(observer, MovingAverageObserver) and ranges.get(name):
                        observer.calibrate(r.amax() for r in ranges[name])
                kernel = KERNELS[kernel_name](module, observer)
                module.quant_method = (
                    "int8 weight-only" if weight_only_layer else f"int8 W8A8 ({kernel.name})"
                )
            else:
                module.quant_method = "int8 embedding"
            _to_int8_class(module, kernel)
        _share_tied_panels(targets.values())


def _share_tied_panels(modules: Iterable[nn.Module]) -> None:
    """An embedding tied to an LM head whose codes moved into panels looks its rows up in
    those panels (as a GGUF file's tied Q8_0 embedding does), so one copy of the codes stays."""
    heads = {
        id(m.weight_scale): m.quant_kernel.packed
        for m in modules
        if isinstance(m, Int8ParallelLMHead)
        and isinstance(m.quant_kernel, WeightOnlyKernel)
        and m.quant_kernel.packed is not None
        and m.quant_kernel.packed.panels
    }
    for m in modules:
        if type(m) is Int8VocabParallelEmbedding and id(m.weight_scale) in heads:
            m.__class__ = PackedVocabParallelEmbedding
            m.packed = heads[id(m.weight_scale)]
            m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)


def batch_dependent(model: nn.Module) -> bool:
    """Whether an int8 layer's activation range still follows the batches it sees (an
    uncalibrated moving-average observer): then a row's result depends on the rows beside it,
    padding rows too."""
    return any(
        isinstance(getattr(kernel, "observer", None), MovingAverageObserver)
        and not kernel.observer.calibrated
        for kernel in (getattr(m, "quant_kernel", None) for m in model.modules())
    )


def describe(model: nn.Module) -> str:
    """What is quantized and how, for the startup log: layers per method, and the layers
    left in full precision (named when there are a few)."""
    counts: dict[str, int] = {}
    full: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, QUANTIZABLE):
            method = getattr(m, "quant_method", None)
            if method is None:
                full.append(name)
            else:
                counts[method] = counts.get(method, 0) + 1
    if not counts:
        return "no layer quantized"
    parts = ", ".join(f"{n} {method}" for method, n in sorted(counts.items()))
    kept = ", ".join(full) if len(full) <= 4 else f"{len(full)} layers"
    return parts + (f"; full precision: {kept}" if full else "")


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters (shared ones once) and packed weights."""
    tensors = list(model.parameters())
    packed = ("weight_packed", "weight_group_scale", "weight_group_offset", "weight_panels")
    tensors += [b for name, b in model.named_buffers() if name.endswith(packed)]
    return sum(t.numel() * t.element_size() for t in tensors)


def calibration_for_folder(folder: str) -> list[list[int]] | None:
    """Calibration windows of :func:`calibration_text` tokenized with the folder's
    tokenizer.json; None (with a warning) where the folder has none."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        logger.warning("no tokenizer.json in %s: int8 runs without its calibration pass", folder)
        return None
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path)).encode(calibration_text()[: CALIBRATION_TOKENS * 8]).ids
    return calibration_windows(ids)

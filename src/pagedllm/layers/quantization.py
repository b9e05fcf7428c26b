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

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import QuantConfig
from pagedllm.layers import cpu_int8
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
    Its result depends on the batches seen before, so greedy output is not batch-invariant."""

    def __init__(self, device: torch.device, averaging_constant: float = 0.01) -> None:
        self.absmax = torch.zeros((), device=device)
        self.averaging_constant = averaging_constant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        current = x.abs().amax().float()
        # The first batch (absmax still 0) sets the range; no host sync either way.
        blended = self.absmax + self.averaging_constant * (current - self.absmax)
        self.absmax.copy_(torch.where(self.absmax == 0, current, blended))
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
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


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
        self.levels = QMAX if _cpu_has_vnni() and cpu_int8.has_vnni() else 63
        self.packed, self.rowsum = cpu_int8.pack(self.qweight)
        self.shape = tuple(self.qweight.shape)
        del self.qweight

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_int8.linear(x.float(), self.packed, self.rowsum, self.scale, self.levels)

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
    """Weight-only int8: the int8 weight is dequantized inside the matmul."""

    name = "weight_only"

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale.to(x.dtype))
        return F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)


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


class Int8VocabParallelEmbedding(VocabParallelEmbedding):
    """Rows are dequantized as they are looked up (an embedding has no matmul)."""

    quant_kernel: None
    dequant_dtype: torch.dtype  # the dtype the float layer's outputs had

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(local_ids, self.weight).float() * self.weight_scale[local_ids, None]
        return rows.to(self.dequant_dtype)


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


@dataclass(frozen=True)
class DynamicQuantConfig(QuantConfig):
    """int8 quantization of a model's linear layers, LM head and embedding (module docstring).

    kernel: one of KERNELS, or None for the fastest the device has (on CPU the C++ cpu_int8
    kernel with the minmax observer, else oneDNN; _int_mm on CUDA; weight-only when
    enable_activation is False).
    """

    kernel: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel is not None and self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {self.kernel!r}.")

    @classmethod
    def from_config(cls, config: QuantConfig) -> DynamicQuantConfig:
        return cls(**dataclasses.asdict(config))

    def targets(
        self, model: nn.Module, exclude_layers: Iterable[str] | None = None
    ) -> dict[str, nn.Module]:
        """Modules to quantize: linear layers, LM head and embedding not excluded nor done."""
        patterns = tuple(self.exclude_layers if exclude_layers is None else exclude_layers)
        candidates = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, QUANTIZABLE) and not hasattr(m, "quant_kernel")
        }
        for p in patterns:
            if not any(_excluded(name, [p]) for name in candidates):
                logger.warning("quantization exclude pattern %r matches no layer", p)
        # A weight shared with an excluded module (tied embeddings) stays as it is too.
        kept = {id(m.weight) for n, m in candidates.items() if _excluded(n, patterns)}
        return {
            n: m
            for n, m in candidates.items()
            if not _excluded(n, patterns) and id(m.weight) not in kept
        }

    def apply(self, model: nn.Module, exclude_layers: Iterable[str] | None = None) -> list[str]:
        """Quantize a loaded model in place; returns the names of the modules quantized.

        exclude_layers (module names or patterns, see _excluded) default to the config's.
        """
        targets = self.targets(model, exclude_layers)
        _replace_weights(targets.values(), lambda w: quantize_weight(w, self.granularity))
        self._bind(targets.values())
        return list(targets)

    def prepare_checkpoint(self, model: nn.Module) -> None:
        """Before loading a pre-quantized checkpoint: int8 parameters for it to fill."""
        if self.prequantized:
            _replace_weights(self.targets(model).values(), _empty_int8)

    def finish_loading(self, model: nn.Module) -> list[str]:
        """After loading: quantize the full-precision weights, or bind the loaded int8 ones."""
        if not self.prequantized:
            return self.apply(model)
        targets = self.targets(model)
        self._bind(targets.values())
        return list(targets)

    def _bind(self, modules: Iterable[nn.Module]) -> None:
        """Install the int8 matmul / forward of each module whose weight is int8 now."""
        for module in modules:
            kernel = None
            if isinstance(module, (LinearBase, ParallelLMHead)):
                name = _kernel_for(module, self.kernel, self.enable_activation, self.observer_type)
                observer = OBSERVERS[self.observer_type](module.weight.device)
                kernel = KERNELS[name](module, observer if self.enable_activation else None)
            _to_int8_class(module, kernel)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters (shared ones once) and packed int8 weights."""
    tensors = list(model.parameters())
    tensors += [b for name, b in model.named_buffers() if name.endswith("weight_packed")]
    return sum(t.numel() * t.element_size() for t in tensors)

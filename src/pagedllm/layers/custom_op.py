"""Ops that pick their implementation once, when they are built (vLLM's CustomOp idea).

An op has ``forward_native`` (torch ops, any device) and may have ``forward_cpu`` (the C++
fused kernels, layers/cpu_fused.py) and ``forward_cuda`` (Triton kernels,
layers/triton_ops.py). Which one ``forward`` runs is decided in ``__init__`` from the
:class:`OpTarget` the loader builds the model under (the device and whether its fused ops
are on, resolved from the engine's frozen config), and from the op's dtype: nothing is
looked up per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.layers import cpu_fused


@dataclass(frozen=True)
class OpTarget:
    """Where the ops being built will run."""

    device_type: str = "cpu"  # "cpu" | "cuda" | ...
    cpu_fused_ops: bool = True  # forward_cpu where the C++ kernels are built (else native)
    cuda_fused_ops: bool = False  # forward_cuda on CUDA (else native; PAGEDLLM_CUDA_FUSED_OPS)

    def uses_cpu_kernels(self, dtype: torch.dtype) -> bool:
        return (
            self.device_type == "cpu"
            and self.cpu_fused_ops
            and dtype in cpu_fused.DTYPES
            and cpu_fused.load()
        )


_target = OpTarget()  # the ops built outside build_target take the CPU defaults


@contextlib.contextmanager
def build_target(target: OpTarget) -> Iterator[None]:
    """Ops built inside pick their implementation for ``target`` (the loader's context)."""
    global _target
    previous, _target = _target, target
    try:
        yield
    finally:
        _target = previous


def current_target() -> OpTarget:
    return _target


class CustomOp(nn.Module):
    """Subclasses implement ``forward_native`` and optionally ``forward_cpu`` / ``forward_cuda``;
    ``impl`` names the one chosen at construction."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        target = current_target()
        self.impl = "native"
        if target.uses_cpu_kernels(dtype) and type(self).forward_cpu is not CustomOp.forward_cpu:
            self.impl = "cpu"
        elif (
            target.device_type == "cuda"
            and target.cuda_fused_ops
            and type(self).forward_cuda is not CustomOp.forward_cuda
        ):
            self.impl = "cuda"
        self._forward: Callable[..., Any] = getattr(self, f"forward_{self.impl}")

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


def triton_ops() -> Any:
    """layers/triton_ops.py, imported on first use: a CPU install never loads Triton."""
    from pagedllm.layers import triton_ops as ops

    return ops

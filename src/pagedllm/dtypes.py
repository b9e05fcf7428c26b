"""The one table of the dtypes pagedllm names: in configs (``dtype``), in the KV cache and on
a split's wire. Torch-free; ``torch_dtype`` imports torch only when called."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> bytes per element. The names are torch's (torch.<name>).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# What a model computes in and its KV cache holds (int8 only travels on a split's wire).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype of a name of DTYPE_BYTES; ValueError for any other name."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}.")
    import torch

    return getattr(torch, name)

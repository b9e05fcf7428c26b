"""Tensor-parallel collectives (``Communicator``, ``OverlapCommunicator``) and process-group
set-up from the standard rendezvous. Names are imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Communicator": "pagedllm.distributed.communicator",
    "OverlapCommunicator": "pagedllm.distributed.communicator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""Tensor-parallel collectives (``Communicator``, ``OverlapCommunicator``) and process-group
set-up from the standard rendezvous. Names are imported on first use."""

from __future__ import annotations

from pagedllm.lazy import lazy_getattr

_EXPORTS = {
    "Communicator": "pagedllm.distributed.communicator",
    "OverlapCommunicator": "pagedllm.distributed.communicator",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)

"""Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1), for the tests
of the GPU kernels on a machine without a GPU."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """TRITON_INTERPRET=1: read when Triton decorates a function and when it launches one."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def _why_not_interpretable() -> str | None:
    if "triton" in sys.modules:  # its own jit functions are compiled ones: cannot interpret
        return "triton was imported before the interpreted tests"
    with interpreting():
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton is missing ({exc})"
    return None


# Decided once, when the first test module that interprets kernels imports this one (before
# anything else imports Triton); every later module shares the answer.
UNAVAILABLE = _why_not_interpretable()


@contextlib.contextmanager
def interpreted(*names: str) -> Iterator[ModuleType]:
    """The first of the modules ``names`` imported afresh under the interpreter (kernels
    decorated there), kept interpreting while the caller's tests run, dropped afterwards."""
    for name in names:
        sys.modules.pop(name, None)
    with interpreting():
        yield importlib.import_module(names[0])
    for name in names:
        sys.modules.pop(name, None)

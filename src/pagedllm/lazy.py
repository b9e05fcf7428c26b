"""Lazy package exports: a package names where each public name lives, and the module that
holds it is imported on first use (so importing the package loads nothing heavy)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for package: name -> the module that defines it."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__

"""The scripts in tools/ and benchmarks/, imported by path (neither is a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


BENCHMARKS = TOOLS.parent / "benchmarks"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (load_script)."""
    return load_script(TOOLS / f"{name}.py", name)


def load_script(path: Path, name: str) -> ModuleType:
    """The script at path as module `name`, imported once (registered in sys.modules, which
    its dataclasses need)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

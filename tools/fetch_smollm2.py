"""Fetches SmolLM2-135M-Instruct (GGUF and a transformers folder) into the user's cache.

    python tools/fetch_smollm2.py

.ci/run calls it before the tests; a second run finds both in the cache and does nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.real_model import smollm2_gguf, smollm2_hf_folder  # noqa: E402

if __name__ == "__main__":
    print(smollm2_gguf())
    print(smollm2_hf_folder())

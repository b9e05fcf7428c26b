"""The model files are the network alone: no looks into torch.nn internals or module
namespaces, no fused-CPU imports (the import-linter contract covers imports; this covers
attribute access the linter cannot see)."""

from __future__ import annotations

import re
from pathlib import Path

import pagedllm.models

FORBIDDEN = re.compile(
    r"torch\.nn\.modules|__dict__|\._parameters\b|\._modules\b|_forward_hooks|vars\("
)


def test_no_model_file_touches_module_internals() -> None:
    folder = Path(pagedllm.models.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert {"llama.py", "qwen3.py", "gemma3.py"} <= {f.name for f in files}
    offenders = [
        f"{f.name}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert offenders == []

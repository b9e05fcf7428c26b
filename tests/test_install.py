"""The default install: xgrammar's own requirements, less triton (a GPU compiler), are
pagedllm's, so that `pip install --no-deps xgrammar` after pagedllm (the README) leaves
structured outputs working on a CPU without the ~1 GB triton wheel."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
GPU_ONLY = {"triton"}


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def default_requirements() -> set[str]:
    """The names in pyproject.toml's [project] dependencies (read as text: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    assert block is not None
    return {name(r) for r in re.findall(r'^\s*"([^"]+)"', block[1], re.M)}


def test_the_default_install_has_what_xgrammar_imports_and_no_gpu_compiler() -> None:
    try:
        requires = importlib.metadata.requires("xgrammar") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("xgrammar is not installed")
    needed = {name(r) for r in requires if "extra ==" not in r} - GPU_ONLY
    ours = default_requirements()
    assert needed <= ours, needed - ours
    assert not (GPU_ONLY | {"xgrammar"}) & ours
    constraints = (ROOT / "constraints.txt").read_text()
    pinned = re.search(r"^xgrammar==(\S+)", constraints, re.M)
    assert pinned is not None and pinned[1] == importlib.metadata.version("xgrammar")


def test_structured_outputs_work_without_triton() -> None:
    """xgrammar's token masks on the CPU path import no triton (what a CPU install lacks)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # as if it were not installed
        "import torch, xgrammar as xgr\n"
        "info = xgr.TokenizerInfo(['a', 'b', '{', '}', '\"', ':'])\n"
        'g = xgr.GrammarCompiler(info).compile_json_schema(\'{"type": "object"}\')\n'
        "m = xgr.GrammarMatcher(g)\n"
        "mask = xgr.allocate_token_bitmask(1, info.vocab_size)\n"
        "m.fill_next_token_bitmask(mask)\n"
        "logits = torch.zeros(1, info.vocab_size)\n"
        "xgr.apply_token_bitmask_inplace(logits, mask)\n"
        "print((logits[0] == 0).nonzero().flatten().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2]"  # only '{' may start a JSON object


def test_the_package_data_ships_every_file_the_cpp_sources_include() -> None:
    """The C++ op libraries compile on the user's machine from the installed package: every
    source and every header a source includes with quotes (beside it, or in pagedllm/csrc,
    which every library has on its include path: balanced_for.h) must match a package-data
    pattern, or an installed wheel falls back to the torch ops."""
    from fnmatch import fnmatch

    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^\[tool\.setuptools\.package-data\]\npagedllm = \[(.*?)\]", text, re.M)
    assert block is not None
    patterns = [p.removeprefix("**/") for p in re.findall(r'"([^"]+)"', block[1])]
    package = ROOT / "src" / "pagedllm"
    sources = sorted(package.glob("**/csrc/*.cpp"))
    shared = package / "csrc"
    included = {
        s.parent / h if (s.parent / h).exists() else shared / h
        for s in sources
        for h in re.findall(r'#include "([^"]+)"', s.read_text())
    }
    assert shared / "balanced_for.h" in included
    assert shared / "bf16_round.h" in included
    for path in [*sources, *included]:
        assert path.exists(), path
        assert any(fnmatch(path.name, p) for p in patterns), f"{path} is not package data"

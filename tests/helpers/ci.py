"""Missing optional tooling: a skip on a developer machine, a failure under CI=true."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    """CI services set CI=true; there every kernel test must run, never skip."""
    return os.environ.get("CI") == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it under CI=true, where a missing toolchain is a broken setup.

    Not for a CPU feature: CI machines differ (AVX2-only, AVX-512 without VNNI, ...), so a
    missing instruction set is a plain ``pytest.skip``."""
    if under_ci():
        pytest.fail(f"{reason} (CI=true: required)", pytrace=False)
    pytest.skip(reason)

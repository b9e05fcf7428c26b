"""The layers' C++ op libraries where they cannot be built: each load() warns once, naming
what runs instead (its callers take that path when load() is False), and returns False."""

from __future__ import annotations

import pytest

from pagedllm import cpp_build
from pagedllm.layers import cpu_fused, cpu_int8, panel_gemm, weight_only


@pytest.mark.parametrize(
    "module,fallback",
    [
        (cpu_fused, "torch ops"),
        (cpu_int8, "oneDNN for every batch size"),
        (panel_gemm, "plain weights"),
        (weight_only, "dequantizing weight slabs for every batch size"),
    ],
)
def test_a_library_that_cannot_be_built_warns_once_and_names_its_fallback(
    module, fallback, monkeypatch, tmp_path
):
    def no_compiler(*args: object) -> None:
        raise RuntimeError("no compiler")

    # a machine with no library built yet, whose build fails
    monkeypatch.setattr(cpp_build, "_build_root", lambda: tmp_path)
    monkeypatch.setattr(cpp_build, "_compile", no_compiler)
    said = f"unavailable .*no compiler.*; using {fallback}$"
    with pytest.warns(RuntimeWarning, match=said) as seen:
        assert module.load.__wrapped__() is False
    assert len(seen) == 1

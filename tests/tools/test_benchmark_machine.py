"""benchmarks/common.py's machine description: the CPU generation beside a guest's model name."""

from __future__ import annotations

from types import ModuleType

import pytest
from helpers.tools import BENCHMARKS, load_script


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return load_script(BENCHMARKS / "common.py", "bench_common")


@pytest.mark.parametrize(
    ("vendor", "family", "model", "core"),
    [
        ("AuthenticAMD", 23, 49, "Zen / Zen 2"),
        ("AuthenticAMD", 25, 1, "Zen 3"),
        ("AuthenticAMD", 25, 17, "Zen 4"),
        ("AuthenticAMD", 25, 97, "Zen 4"),
        ("AuthenticAMD", 26, 2, "Zen 5"),
        ("GenuineIntel", 6, 85, "Skylake-SP / Cascade Lake"),
        ("GenuineIntel", 6, 143, "Sapphire Rapids"),
        ("GenuineIntel", 6, 1, ""),
        ("HygonGenuine", 24, 0, ""),
    ],
)
def test_microarchitecture_from_cpuid_family_and_model(
    common: ModuleType, vendor: str, family: int, model: int, core: str
) -> None:
    assert common.microarchitecture(vendor, family, model) == core


def _cpuinfo(monkeypatch: pytest.MonkeyPatch, common: ModuleType, fields: dict[str, str]) -> None:
    monkeypatch.setattr(common, "_cpuinfo_field", lambda name: fields.get(name, ""))


def test_cpu_model_names_the_generation_a_guest_leaves_out(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {"model name": "AMD EPYC", "vendor_id": "AuthenticAMD", "cpu family": "26",
              "model": "2"}  # fmt: skip
    _cpuinfo(monkeypatch, common, fields)
    assert common.cpu_model() == "AMD EPYC, Zen 5, family 26 model 2"
    fields["vendor_id"] = "GenuineIntel"  # a family and model it cannot name: still printed
    assert common.cpu_model() == "AMD EPYC, family 26 model 2"


def test_cpu_model_without_family_is_the_model_name(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cpuinfo(monkeypatch, common, {"model name": "Neoverse-V2"})
    assert common.cpu_model() == "Neoverse-V2"
    _cpuinfo(monkeypatch, common, {})
    assert common.cpu_model() == "unknown CPU"

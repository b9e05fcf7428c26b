"""cpu_info: the flags line of /proc/cpuinfo, read once, on x86 and Arm text, and what happens
where there is no such line or no file."""

from __future__ import annotations

import platform

from pagedllm.cpu_info import cpu_flags, cpu_flags_line

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 fma f16c
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx2 fma f16c avx512f
"""

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes crc32 bf16
CPU implementer\t: 0x41
"""


def test_the_first_flags_line_gives_the_flags(tmp_path):
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    assert cpu_flags_line(str(tmp_path / "x86")) == "flags\t\t: fpu sse2 avx2 fma f16c"
    assert cpu_flags(str(tmp_path / "x86")) == {"fpu", "sse2", "avx2", "fma", "f16c"}
    assert cpu_flags(str(tmp_path / "arm")) == {"fp", "asimd", "evtstrm", "aes", "crc32", "bf16"}


def test_without_a_flags_line_or_a_file_there_are_no_flags(tmp_path):
    bare = tmp_path / "bare"
    bare.write_text("processor\t: 0\nmodel name\t: something\n")
    assert cpu_flags_line(str(bare)) == bare.read_text()  # the builds hash the whole text
    assert cpu_flags(str(bare)) == frozenset()
    missing = str(tmp_path / "missing")
    assert cpu_flags_line(missing) == platform.processor()
    assert cpu_flags(missing) == frozenset()

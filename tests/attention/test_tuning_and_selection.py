"""Cache-size-driven tiles, their overrides, and how a backend is chosen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.attention import get_tuning, tuning
from pagedllm.attention.backend import available_backends, default_backend_name


def test_cpu_caches_come_from_the_os():
    caches = tuning.cpu_caches()
    sysfs = "/sys/devices/system/cpu/cpu0/cache/index0/size"
    try:
        with open(sysfs) as f:
            first = tuning._parse_size(f.read())
    except OSError:
        pytest.skip("no sysfs cache information")
    assert caches.l1_bytes == first and caches.l2_bytes >= caches.l1_bytes


def test_rule_follows_cache_sizes():
    small = tuning.CacheInfo(l1_bytes=16 << 10, l2_bytes=256 << 10, shared_mem_bytes=0, num_units=1)
    big = tuning.CacheInfo(l1_bytes=64 << 10, l2_bytes=2 << 20, shared_mem_bytes=0, num_units=1)
    # K+V fp32 tile <= L1: 16 KiB / (2 * 64 * 4) = 32 keys; Q+O rows <= L2/4: 64 KiB / 2 KiB.
    assert tuning.cpu_rule(small, 64, 4) == dict(block_m=32, block_n=32, num_stages=2, split_keys=0)
    assert tuning.cpu_rule(big, 64, 4)["block_n"] == 128
    hopper = tuning.CacheInfo(0, 50 << 20, 227 << 10, 132)
    ampere_small = tuning.CacheInfo(0, 4 << 20, 99 << 10, 46)
    h = tuning.cuda_rule(hopper, 128, 2)
    # (227 KiB - 32 KiB query tile) / 32 KiB per K+V stage = 6, capped at 4; 50 MiB / 132 SMs.
    assert h["block_m"] == 128 and h["num_stages"] == 4 and h["split_keys"] == 512
    a = tuning.cuda_rule(ampere_small, 128, 2)
    assert a["block_m"] == 64 and a["num_stages"] == 2 and a["split_keys"] == 256


def test_overrides_by_tiles_and_argument():
    t = get_tuning("cpu", 64, 2, torch.float32, "block_m=8,block_n=48")
    assert (t.block_m, t.block_n, t.source) == (8, 48, "env")
    t = get_tuning("cpu", 64, 2, torch.float32, "block_m=8,block_n=48", num_stages=1)
    assert (t.block_m, t.num_stages, t.source) == (8, 1, "arg")
    with pytest.raises(ValueError, match="bad entry"):
        get_tuning("cpu", 64, 2, torch.float32, "block_q=8")


def test_engine_tiles_come_from_the_config(monkeypatch, tiny_llama):
    """PAGEDLLM_ATTENTION_TILES is read once, into the engine's KernelConfig, and the runner's
    backend (and with it the fused decoder) uses those tiles."""
    from pagedllm import LLM
    from pagedllm.config import EngineArgs

    monkeypatch.setenv("PAGEDLLM_ATTENTION_TILES", "block_m=16,block_n=32")
    config = EngineArgs(model=str(tiny_llama)).create_engine_config()
    assert config.device.kernels.attention_tiles == "block_m=16,block_n=32"
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=1 << 20)
    monkeypatch.delenv("PAGEDLLM_ATTENTION_TILES")
    runner = llm.llm_engine.executor.local_runner
    layer = runner.model.attention_layers()[0]
    tiles = runner.backend.cpu_kernel_tiles(torch.float32, layer.num_heads, layer.key_cache)
    assert tiles == (16, 32)


def test_choice_is_logged_once(caplog):
    tuning._tuning.cache_clear()
    with caplog.at_level("INFO", logger="pagedllm.attention.tuning"):
        for _ in range(3):
            get_tuning("cpu", 80, 5, torch.float16)
    lines = [r.message for r in caplog.records if "block_m=" in r.message]
    assert len(lines) == 1 and "L1d" in lines[0]


def test_default_backends_by_device():
    assert {"torch", "cpu", "triton"} <= set(available_backends())
    assert default_backend_name(torch.device("cpu")) == "cpu"
    assert default_backend_name(torch.device("cuda")) == "triton"


def test_cpu_install_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from pagedllm.attention import flash_attn_func\n"
        "from pagedllm.attention.backend import get_attention_backend\n"
        "for name in (None, 'cpu', 'torch'):\n"
        "    get_attention_backend(name, torch.device('cpu'))\n"
        "q = torch.randn(1, 3, 2, 16)\n"
        "flash_attn_func(q, q, q, causal=True)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_failed_build_warns_and_falls_back_to_torch(monkeypatch, tmp_path):
    from pagedllm import cpp_build
    from pagedllm.attention import cpu_backend, cpu_kernels
    from pagedllm.attention.torch_backend import TorchAttentionBackend

    def no_compiler(*args: object) -> None:
        raise RuntimeError("no compiler")

    # a machine with no kernel built yet, whose build fails
    monkeypatch.setattr(cpp_build, "_build_root", lambda: tmp_path)
    monkeypatch.setattr(cpp_build, "_compile", no_compiler)
    with pytest.warns(RuntimeWarning, match="using the torch attention path"):
        assert cpu_kernels.load.__wrapped__() is False
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    backend = cpu_backend.CpuAttentionBackend()
    calls = []
    monkeypatch.setattr(TorchAttentionBackend, "forward", lambda *args: calls.append(args))
    backend.forward(*[None] * 8)
    assert len(calls) == 1


def test_a_build_is_named_after_its_source_and_the_headers_it_may_include(tmp_path):
    """A header beside a source, or in the folder every library has on its include path
    (pagedllm/csrc: balanced_for.h, bf16_round.h), changes the name of each build that may
    include it, so no process loads a library built from the old header."""
    from pagedllm import cpp_build

    source, shared = tmp_path / "lib" / "ops.cpp", tmp_path / "shared"
    source.parent.mkdir()
    shared.mkdir()
    source.write_text('#include "beside.h"\n#include "common.h"\n')
    (source.parent / "beside.h").write_text("// one\n")
    (shared / "common.h").write_text("// one\n")
    name = lambda: cpp_build.build_name(["-O3"], source, "ops", shared)  # noqa: E731
    names = [name()]
    (source.parent / "beside.h").write_text("// two\n")
    names.append(name())
    (shared / "common.h").write_text("// two\n")
    names.append(name())
    (shared / "other.h").write_text("// three\n")
    names.append(name())
    (shared / "other.h").rename(source.parent / "other.h")  # the same text, moved
    names.append(name())
    source.write_text('#include "beside.h"\n// changed\n')
    names.append(name())
    (shared / "notes.txt").write_text("not a header\n")
    assert name() == names[-1]  # a text file is no header
    assert len(set(names)) == len(names)
    assert all(n.startswith("ops_generic_") for n in names)
    assert cpp_build.SHARED_HEADERS == Path(cpp_build.__file__).parent / "csrc"
    assert (cpp_build.SHARED_HEADERS / "bf16_round.h").exists()

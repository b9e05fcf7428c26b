"""grpcio is the split's extra (pagedllm[split]): without it, everything but the split works
and the split says how to install it."""

from __future__ import annotations

import subprocess
import sys

# A Python where `import grpc` fails, as on an install without pagedllm[split].
NO_GRPC = "import sys; sys.modules['grpc'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_GRPC + code], capture_output=True, text=True, timeout=300
    )


def test_the_split_without_grpcio_names_the_extra(tiny_llama, tmp_path):
    code = (
        "from pagedllm import LLM\n"
        f"LLM({str(tiny_llama)!r}, kv_cache_memory_bytes=1 << 20,\n"
        f"    partition_config={{'plan': {str(tmp_path / 'p.json')!r}, 'address': 'h:1'}})\n"
    )
    proc = _run(code)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "pip install 'pagedllm[split]'" in last, last


def test_the_split_worker_command_without_grpcio_says_so(tiny_llama, tmp_path):
    code = (
        "from pagedllm.entrypoints.cli import main\n"
        f"raise SystemExit(main(['split-worker', {str(tiny_llama)!r}, "
        f"'--partition', {str(tmp_path / 'p.json')!r}]))\n"
    )
    proc = _run(code)
    assert proc.returncode == 1, proc.stderr
    assert "pip install 'pagedllm[split]'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_engine_without_grpcio_runs(tiny_llama):
    code = (
        "from pagedllm import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, kv_cache_memory_bytes=1 << 20)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),"
        " use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "assert 'grpc' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr

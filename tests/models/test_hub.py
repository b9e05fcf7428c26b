"""Hub ids through huggingface_hub, offline, from a cache the test lays out itself.

The cache has huggingface_hub's own structure (``hub/models--org--name/snapshots/<commit>/``,
``refs/<branch or tag>`` naming the commit); with ``HF_HUB_OFFLINE=1`` nothing touches the
network, so the ids resolve from it or fail with the offline error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.hub import looks_like_hub_id, resolve_model

MAIN, TAGGED = "a" * 40, "b" * 40


def _add_snapshot(hub: Path, repo: str, commit: str, folder: Path, ref: str) -> None:
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(model_factory, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    hub = home / "hub"
    _add_snapshot(hub, "tiny-org/tiny-llama", MAIN, model_factory("llama"), "main")
    _add_snapshot(hub, "tiny-org/tiny-llama", TAGGED, model_factory("llama", seed=1), "v1")
    return home


def _generate(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", *args]
    cmd += ["--max-tokens", "6", "--ignore-eos", "--kv-cache-memory-bytes", str(1 << 20)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _expected(folder: Path, prompt: str) -> str:
    llm = LLM(model=str(folder), kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return prompt + llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_hub_id_and_revision_load_from_the_offline_cache(hub_cache, model_factory):
    main = _generate(hub_cache, "--model", "tiny-org/tiny-llama", "The quick")
    assert main.returncode == 0, main.stderr
    assert main.stdout.strip() == _expected(model_factory("llama"), "The quick").strip()
    tagged = _generate(hub_cache, "--model", "tiny-org/tiny-llama", "--revision", "v1", "The quick")
    assert tagged.returncode == 0, tagged.stderr
    assert tagged.stdout.strip() == _expected(model_factory("llama", seed=1), "The quick").strip()
    assert main.stdout != tagged.stdout  # the revision chose the other snapshot


def test_a_hub_id_not_in_the_offline_cache_says_what_to_do(hub_cache):
    proc = _generate(hub_cache, "--model", "tiny-org/absent", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr and "hf download tiny-org/absent" in proc.stderr
    proc = _generate(hub_cache, "--model", "tiny-org/tiny-llama", "--revision", "v9", "hi")
    assert proc.returncode == 2 and "--revision v9" in proc.stderr


def test_local_paths_are_never_taken_for_hub_ids(model_factory, tmp_path):
    folder = str(model_factory("llama"))
    assert resolve_model(folder) == folder
    assert resolve_model("./relative/dir") == "./relative/dir"
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for not_an_id in ("/abs/path", "./a/b", "a/b/c", "model.gguf", "org/"):
        assert not looks_like_hub_id(not_an_id), not_an_id

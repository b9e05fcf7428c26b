"""deploy/Dockerfile: the image builds, its kernels are compiled into it, and a container of it
serves the bundled model and answers /health.

Needs a container runtime (``docker info`` answers): skipped with the reason otherwise. The
CI guard does not turn that skip into a failure, because the CI machine runs the suite
itself in a container without a Docker daemon."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).parents[2]
MODEL = "/app/models/pagedllm-demo"


def docker_unavailable() -> str | None:
    """Why no container can be built here, or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"docker info fails: {lines[-1] if lines else info.returncode}"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    reason = docker_unavailable()
    if reason is not None:
        pytest.skip(f"no container runtime ({reason})")
    tag = f"pagedllm-test:{uuid.uuid4().hex[:8]}"
    build = subprocess.run(
        ["docker", "build", "-f", "deploy/Dockerfile", "-t", tag, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    yield tag
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=300)


def docker(*args: str, timeout: float = 120) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_the_image_serves_the_bundled_model_with_its_built_kernels(image: str) -> None:
    name = f"pagedllm-test-{uuid.uuid4().hex[:8]}"
    docker(
        "run", "-d", "--name", name, "-p", "127.0.0.1::8000",
        "-v", f"{ROOT / 'models'}:/app/models:ro",
        image, "serve", MODEL, "--host", "0.0.0.0", "--port", "8000",
    )  # fmt: skip
    try:
        port = docker("port", name, "8000/tcp").splitlines()[0].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600  # ends a hang only
        while not healthy(url):
            running = docker("inspect", "-f", "{{.State.Running}}", name)
            assert running == "true", docker("logs", name)
            assert time.monotonic() < deadline, docker("logs", name)
            time.sleep(0.5)
        body = {"model": MODEL, "prompt": "A dictionary is", "max_tokens": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        out = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        logs = out.stdout + out.stderr
        # the image's builds were used: nothing compiled at start, no fallback to torch ops
        assert "compiling the" not in logs, logs
        assert "unavailable" not in logs, logs
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_the_kernel_cache_is_where_compose_keeps_its_volume() -> None:
    """The image's TORCH_EXTENSIONS_DIR lies in the folder compose mounts a named volume at,
    so the builds of a CPU other than the build machine's are kept across starts."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    env = next(ln for ln in dockerfile.splitlines() if ln.startswith("ENV TORCH_EXTENSIONS_DIR="))
    cache = Path(env.split("=", 1)[1])
    assert f"VOLUME {cache.parent}" in dockerfile
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    mounts = compose["services"]["pagedllm"]["volumes"]
    named = {m.split(":")[0]: m.split(":")[1] for m in mounts if not m.startswith((".", "/"))}
    assert named.get("kernels") == str(cache.parent) and "kernels" in compose["volumes"]
    assert "-c constraints.txt torch" in dockerfile  # torch at the pinned version

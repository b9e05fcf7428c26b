"""pagedllm as a Ray Serve application on a local Ray (2 CPUs, 2 replicas of the demo model):
the OpenAI routes on Serve's HTTP proxy, each replica an async engine behind pagedllm's own
app, prefix-affinity routing by Serve's request-router API, a killed replica restarted by
Ray. `serve run pagedllm.ray:build_app model=PATH num_replicas=2` passes build_app the same
string arguments as these tests do."""

from __future__ import annotations

import os
import re
from unittest import mock

import httpx
import pytest
from helpers.replicas import DEMO, free_port, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from pagedllm.ray import build_app, deployment_options, engine_kwargs  # noqa: E402

ARGS = {
    "model": str(DEMO),
    "num_replicas": "2",
    "served_model_name": "demo",
    "kv_cache_memory_bytes": "8388608",
    "prefix_affinity": "true",
}
SHARED = "Deep in the northern forest a small fox searched every morning for berries and " * 4


# Serve's controller kills an HTTP proxy that misses its 5 s ready check or 10 s health
# check; with both cores busy a starting proxy can be slower than that. Ray's own settings
# (read by the controller, which inherits the environment of ray.init) give it a minute.
SLOW_MACHINE = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


@pytest.fixture(scope="module")
def proxy() -> str:
    port = free_port()
    with mock.patch.dict(os.environ, SLOW_MACHINE):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ARGS), name="pagedllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: str, key: str | None = None) -> httpx.Response:
    headers = {"x-prefix-key": key} if key else {}
    body = {"model": "demo", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def running_replicas() -> int:
    status = serve.status().applications["pagedllm"].deployments["pagedllm"]
    return status.replica_states.get("RUNNING", 0)


def test_openai_routes_on_the_serve_proxy(proxy: str) -> None:
    assert running_replicas() == 2
    assert [m["id"] for m in httpx.get(proxy + "/v1/models").json()["data"]] == ["demo"]
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(proxy + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    bad = httpx.post(proxy + "/v1/completions", json={"model": "demo", "prompt": "x", "n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"  # pagedllm's errors
    assert httpx.get(proxy + "/health").status_code == 200
    assert "vllm:num_requests_waiting{" in httpx.get(proxy + "/metrics").text
    answered = {complete(proxy, f"hello {i}").headers["x-pagedllm-replica"] for i in range(20)}
    assert len(answered) == 2  # both replicas serve the keyless requests


def test_prefix_affinity_keeps_a_key_on_one_replica(proxy: str) -> None:
    for key in ("doc-a", "doc-b", "doc-c"):
        replicas = {
            complete(proxy, SHARED + f"{key} {i}", key).headers["x-pagedllm-replica"]
            for i in range(4)
        }
        assert len(replicas) == 1, (key, replicas)
        # /metrics with the same key is answered by that replica: its prefix cache was hit
        # by the three requests after the first (4 blocks of 16 tokens each at least)
        metrics = httpx.get(proxy + "/metrics", headers={"x-prefix-key": key})
        assert metrics.headers["x-pagedllm-replica"] in replicas
        hits = float(
            re.search(r"^vllm:prefix_cache_hits_total\{.*\} (\S+)$", metrics.text, re.M)[1]
        )
        assert hits >= 3 * 64


def test_a_killed_replica_is_restarted_by_ray(proxy: str) -> None:
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::pagedllm#pagedllm#")
    ]
    assert len(names) == 2
    victim = names[0].rsplit("#", 1)[1]
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    # A bound against a hang, not a timing: with both cores busy, Ray took over 180 s.
    wait_until(lambda: running_replicas() == 2 and len(current_replicas()) == 2, 900, "restart")
    assert victim not in current_replicas()
    for i in range(4):  # answered throughout
        assert complete(proxy, f"after {i}").status_code == 200


def current_replicas() -> set[str]:
    return {
        a["name"].rsplit("#", 1)[1]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::pagedllm#pagedllm#")
    }


def test_builder_arguments() -> None:
    kwargs = engine_kwargs({**ARGS, "max_model_len": "256", "enable_prefix_caching": "false"})
    assert kwargs["max_model_len"] == 256 and kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory_bytes"] == 8388608 and "num_replicas" not in kwargs
    with pytest.raises(ValueError, match="max_model_len='many'"):
        engine_kwargs({"max_model_len": "many"})
    with pytest.raises(ValueError, match=r"unknown arguments \['replicas'\]"):
        engine_kwargs({"replicas": "2"})
    fixed = deployment_options({"num_replicas": "3"})
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    auto = deployment_options({"min_replicas": "1", "max_replicas": "4"})
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 8.0,
    }
    assert "num_replicas" not in auto

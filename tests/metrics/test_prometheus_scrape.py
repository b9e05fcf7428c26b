"""A real Prometheus scrapes a live server while requests run; every query of every panel of
the Grafana dashboard is then evaluated through Prometheus' HTTP API and must return data.

Needs the ``prometheus`` binary (Debian's package); skipped without it, except under CI=true
where a missing binary fails the test.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from helpers.ci import unavailable

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedllm.json"
MODEL = "tiny"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        unavailable("the prometheus binary is missing (apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_llama) -> Iterator[str]:
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    app = build_app(args, [MODEL], log_stats_interval=None)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus(server_url, tmp_path_factory) -> Iterator[str]:
    """Prometheus with deploy/'s scrape config, pointed at the test server, scraping every 1 s."""
    binary = prometheus_binary()
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [server_url.removeprefix("http://")]}]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200, proc, 30)
        wait_for(lambda: instant(url, 'up{job="pagedllm"}') == [1.0], proc, 30)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(check, proc: subprocess.Popen, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {proc.stderr.read()}")
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus did not get ready")


def query(prometheus_url: str, expr: str) -> list[dict]:
    r = httpx.get(prometheus_url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def instant(prometheus_url: str, expr: str) -> list[float]:
    return [float(item["value"][1]) for item in query(prometheus_url, expr)]


def last_scrape(prometheus_url: str) -> float:
    """When Prometheus last scraped the server (its sample time), 0 before the first."""
    return max(instant(prometheus_url, 'timestamp(up{job="pagedllm"})'), default=0.0)


def wait_scrapes(prometheus_url: str, n: int, timeout: float = 60.0) -> None:
    """Wait until Prometheus has scraped the server n more times."""
    deadline = time.monotonic() + timeout
    seen, count = last_scrape(prometheus_url), 0
    while count < n:
        assert time.monotonic() < deadline, f"{count} of {n} scrapes in {timeout:.0f} s"
        time.sleep(0.1)
        latest = last_scrape(prometheus_url)
        count, seen = count + (latest > seen), max(seen, latest)


def run_traffic(url: str, prometheus_url: str, min_requests: int) -> int:
    """Completions, chat and streams from 4 threads, with a shared prefix for cache hits,
    until at least min_requests are done and Prometheus has scraped twice meanwhile (so
    that every rate() has samples inside the traffic). Returns the requests done; a
    worker's failure is raised here, not lost in its thread."""
    shared = "The quick brown fox jumps over the lazy dog. A list is a mutable sequence. "
    stop = threading.Event()
    done: list[int] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                i = 0
                while not stop.is_set():
                    i += 1
                    body = {"prompt": shared + f"{k} {i}", "max_tokens": 8 + i % 8}
                    body["temperature"] = 0
                    if i % 3 == 0:
                        body |= {"stream": True, "stop": ["e"]}
                    if i % 4 == 0:
                        chat = {"messages": [{"role": "user", "content": shared}], "max_tokens": 6}
                        r = client.post("/v1/chat/completions", json=chat)
                    else:
                        r = client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    done.append(1)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_scrapes(prometheus_url, 2)
        deadline = time.monotonic() + 120
        while len(done) < min_requests and not errors:
            assert time.monotonic() < deadline, f"{len(done)} of {min_requests} requests"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return len(done)


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would fill them for this test's short run."""
    expr = expr.replace("$__rate_interval", "1m").replace("${__rate_interval}", "1m")
    return re.sub(r"\$\{?model_name\}?", MODEL, expr)


def test_every_dashboard_query_returns_data(server_url, prometheus) -> None:
    run_traffic(server_url, prometheus, min_requests=12)  # raises unless they all succeed
    wait_scrapes(prometheus, 2)  # two more scrapes after the last request
    queries = panel_queries()
    assert len(queries) >= 20
    titles = {title for title, _ in queries}
    for wanted in ("TTFT", "ITL", "KV-cache", "Prefix-cache", "Preemptions", "Running"):
        assert any(wanted in t for t in titles), wanted
    for title, expr in queries:
        values = [float(item["value"][1]) for item in query(prometheus, substitute(expr))]
        assert values, f"panel {title!r}: no data for {expr}"
        assert any(math.isfinite(v) for v in values), f"panel {title!r}: {expr} -> {values}"


def test_dashboard_variables_resolve(server_url, prometheus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
        assert m, var["definition"]
        series = query(prometheus, m[1])
        assert MODEL in {s["metric"].get(m[2]) for s in series}


def test_deploy_prometheus_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool is missing (it ships with Debian's prometheus package)")
    config = DEPLOY / "prometheus" / "prometheus.yml"
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr

"""pagedllm on Ray Serve: the OpenAI-compatible server as a Serve application.

    serve run pagedllm.ray:build_app model=PATH num_replicas=2

``build_app`` follows Serve's application-builder convention: it takes the ``key=value``
arguments of ``serve run`` (or the ``args`` of a Serve config file) and returns the bound
application. Each replica builds the same FastAPI app as ``pagedllm serve`` around its own
async engine (``__serve_build_asgi_app__``, on the replica), so the routes, errors and
metrics are the server's; Ray Serve's HTTP proxy forwards to it. A replica whose engine
died fails Serve's health check and is replaced by Ray.

Arguments (all strings on the command line):

- ``model`` and any other EngineArgs field (``max_model_len=2048``, ``block_size=16`` ...),
  converted to the field's type; ``served_model_name`` (comma-separated names);
- ``num_replicas`` (default 1), or autoscaling on ongoing requests with ``min_replicas``,
  ``max_replicas`` and ``target_ongoing_requests`` (default 8);
- ``num_cpus`` per replica (default 1; torch uses as many threads);
- ``prefix_affinity=true``: Serve's request router (``PrefixAffinityRouter``) sends requests
  with the same ``x-prefix-key`` header (over HTTP; a handle call's prompt otherwise) to the
  same replica, so its prefix cache is hit.

Every response names the replica that answered in its ``x-pagedllm-replica`` header.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import random
from typing import Any

try:
    from ray import serve
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("pagedllm.ray needs Ray Serve: pip install 'pagedllm[ray]'") from e

from pagedllm.config import EngineArgs

_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
_SERVE_KEYS = {
    "num_replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "num_cpus",
    "served_model_name",
    "prefix_affinity",
    "name",
}
PREFIX_CHARS = 256  # how much of a prompt picks its replica


class PagedLLMServer:
    """One replica: an AsyncLLMEngine behind pagedllm's FastAPI app."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_names: list[str]) -> None:
        self.engine_args = EngineArgs(**engine_kwargs)
        self.served_model_names = served_model_names or None
        self._pagedllm_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from pagedllm.entrypoints.openai.server import build_app

        app = build_app(self.engine_args, self.served_model_names, log_stats_interval=None)
        self._pagedllm_app = app  # not self.app: Serve's wrapper owns that name
        replica = serve.get_replica_context().replica_id.unique_id

        @app.middleware("http")
        async def name_the_replica(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            response.headers["x-pagedllm-replica"] = replica  # which replica answered
            return response

        return app

    def check_health(self) -> None:
        """Serve's periodic probe: a dead engine makes Ray replace the replica."""
        app = self._pagedllm_app
        engine = None if app is None else app.state.engine
        if engine is not None and engine.errored:
            raise RuntimeError(f"the engine is dead: {engine.dead_error}")


def engine_kwargs(args: dict[str, str]) -> dict[str, Any]:
    """EngineArgs fields from ``serve run`` strings; ValueError names an unknown key."""
    unknown = sorted(set(args) - set(_ENGINE_FIELDS) - _SERVE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown arguments {unknown}: use EngineArgs fields or {sorted(_SERVE_KEYS)}."
        )
    kwargs = {}
    for key, raw in args.items():
        if key in _ENGINE_FIELDS:
            kwargs[key] = _convert(key, raw)
    return kwargs


def _convert(key: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw  # a Serve config file's YAML already typed it
    kind = str(_ENGINE_FIELDS[key].type)
    default = _ENGINE_FIELDS[key].default
    try:
        if isinstance(default, bool) or kind.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if isinstance(default, int) or kind.startswith("int"):
            return int(raw)
        if isinstance(default, float) or kind.startswith("float"):
            return float(raw)
        if kind.startswith("list"):
            return raw.split(",")
        if kind.startswith("dict"):
            return json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{key}={raw!r} is not a valid {kind}.") from e
    return raw


def deployment_options(args: dict[str, Any]) -> dict[str, Any]:
    """Serve options: fixed replicas, or autoscaling on ongoing requests per replica."""
    cpus = float(args.get("num_cpus", 1))
    options: dict[str, Any] = {
        "name": str(args.get("name", "pagedllm")),
        "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": _thread_env(cpus)}},
        "health_check_period_s": 5,
        "max_ongoing_requests": 64,
    }
    if "min_replicas" in args or "max_replicas" in args:
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", 4)),
            "target_ongoing_requests": float(args.get("target_ongoing_requests", 8)),
        }
    else:
        options["num_replicas"] = int(args.get("num_replicas", 1))
    if str(args.get("prefix_affinity", "false")).lower() in ("true", "1"):
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class="pagedllm.ray:PrefixAffinityRouter"
        )
    return options


def _thread_env(cpus: float) -> dict[str, str]:
    threads = str(max(1, int(cpus)))
    return {"OMP_NUM_THREADS": threads, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def build_app(args: dict[str, Any]) -> Any:
    """Serve's application builder: ``serve run pagedllm.ray:build_app model=PATH ...``."""
    args = dict(args)
    kwargs = engine_kwargs(args)
    names = [n for n in str(args.get("served_model_name", "")).split(",") if n]
    deployment = serve.deployment(serve.ingress()(PagedLLMServer))
    return deployment.options(**deployment_options(args)).bind(kwargs, names)


# ---- prefix-affinity routing ------------------------------------------------------------------
try:
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError:  # a Ray without the request-router API: no prefix affinity
    RequestRouter = object  # type: ignore[assignment,misc]

PREFIX_HEADER = b"x-prefix-key"


def prompt_key(pending: Any) -> str | None:
    """What picks the request's replica: the beginning of its prompt for a handle call with a
    dict body, else the ``x-prefix-key`` header of an HTTP request. Serve's proxy chooses the
    replica before it reads an HTTP body, so over HTTP the client names what its requests
    share (a system prompt, a document, a conversation) in that header."""
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, bytes):  # an HTTP request, serialized by the proxy
            try:
                arg = pickle.loads(arg)
            except Exception:  # noqa: BLE001 - not ours to read: route it without a key
                continue
        scope = getattr(arg, "asgi_scope", None)
        if isinstance(scope, dict):
            for name, value in scope.get("headers", ()):
                if name.lower() == PREFIX_HEADER:
                    return value.decode("latin-1")
            continue
        if isinstance(arg, dict):
            prompt = arg.get("prompt", arg.get("messages"))
            if prompt is not None:
                return json.dumps(prompt)[:PREFIX_CHARS]
    return None


class PrefixAffinityRouter(RequestRouter):  # type: ignore[misc,valid-type]
    """Requests with the same key (see ``prompt_key``) go to one replica, chosen by rendezvous
    hashing over the replicas (adding one moves only its share), with the rest as fallbacks
    in the same order if it is full; requests without a key go to the less loaded of two
    random replicas, as Serve's default router does."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        key = None if pending_request is None else prompt_key(pending_request)
        if key is None or not candidate_replicas:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

        def rank(replica: RunningReplica) -> bytes:
            return hashlib.sha256(f"{key}|{replica.replica_id.unique_id}".encode()).digest()

        ranked = sorted(candidate_replicas, key=rank)
        return [[ranked[0]], ranked[1:]]

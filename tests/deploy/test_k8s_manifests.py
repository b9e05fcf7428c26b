"""deploy/k8s, checked offline (no cluster runs in the suite): the core objects against the
Kubernetes OpenAPI schemas bundled by kubernetes-validate (strict: an unknown field fails),
the Gateway API Inference Extension's InferencePool and the Gateway API's HTTPRoute against
schemas of their v1 fields written here, and the objects against each other and against
pagedllm itself: the container's arguments parse as `pagedllm serve` flags, its KV-events
JSON is a valid kv_events_config, the metric the HPA scales on is one the server exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.metrics.prometheus import PrometheusStatLogger

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31.0"

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}}
INFERENCE_POOL_V1 = {  # inference.networking.k8s.io/v1 InferencePoolSpec
    "type": "object",
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "additionalProperties": False,
    "properties": {
        "selector": {
            "type": "object",
            "required": ["matchLabels"],
            "additionalProperties": False,
            "properties": {"matchLabels": {**_LABELS, "minProperties": 1}},
        },
        "targetPorts": {
            "type": "array",
            "minItems": 1,
            "maxItems": 8,
            "items": {
                "type": "object",
                "required": ["number"],
                "additionalProperties": False,
                "properties": {"number": _PORT},
            },
        },
        "endpointPickerRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "group": {"type": "string"},
                "kind": {"type": "string"},
                "name": _NAME,
                "port": {
                    "type": "object",
                    "required": ["number"],
                    "additionalProperties": False,
                    "properties": {"number": _PORT},
                },
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}
HTTP_ROUTE_V1 = {  # gateway.networking.k8s.io/v1 HTTPRouteSpec, the fields used here
    "type": "object",
    "required": ["parentRefs", "rules"],
    "properties": {
        "parentRefs": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
        },
        "rules": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "matches": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "path": {
                                    "type": "object",
                                    "properties": {
                                        "type": {
                                            "enum": [
                                                "Exact",
                                                "PathPrefix",
                                                "RegularExpression",
                                            ]
                                        },
                                        "value": {"type": "string", "pattern": "^/"},
                                    },
                                }
                            },
                        },
                    },
                    "backendRefs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "group": {"type": "string"},
                                "kind": {"type": "string"},
                                "name": _NAME,
                            },
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_V1,
}


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] == kind]


def test_every_object_is_valid_for_its_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for obj in objects():
        kinds.add(obj["kind"])
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is None:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}
            jsonschema.validate(obj["spec"], schema)
    wanted = {"Deployment", "Service", "HorizontalPodAutoscaler", "InferencePool", "HTTPRoute"}
    assert wanted <= kinds


def test_the_checks_catch_a_broken_object() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    (deployment,) = by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    (pool,) = by_kind("InferencePool")
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool["spec"], INFERENCE_POOL_V1)


def test_objects_agree_with_each_other_and_with_pagedllm() -> None:
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in by_kind("Service"):
        assert service["spec"]["selector"].items() <= labels.items()
    (pool,) = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # the arguments are `pagedllm serve` flags, the events JSON a valid kv_events_config
    ns = build_parser().parse_args(container["args"])
    assert ns.command == "serve" and ns.port == ports["http"] and ns.disable_metrics_auth
    config = engine_args_from(ns)
    from pagedllm.kv_events_config import parse_kv_events_config

    events = parse_kv_events_config(config.kv_events_config)
    assert events is not None and events.endpoint.endswith(f":{ports['kv-events']}")
    assert events.replay_endpoint.endswith(f":{ports['kv-replay']}")
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes
    (claim,) = by_kind("PersistentVolumeClaim")
    assert (
        pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    )


def test_the_hpa_scales_on_a_metric_the_server_exports() -> None:
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    (deployment,) = by_kind("Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "vllm_num_requests_waiting"
    (adapter,) = by_kind("ConfigMap")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    exported = PrometheusStatLogger("m", 64, process_metrics=False).render().decode()
    renamed = []
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0]
        assert f"\n{series}{{" in exported, series  # a series the server really has
        assert rule["name"] == {"matches": "^vllm:(.*)$", "as": "vllm_${1}"}
        renamed.append("vllm_" + series.removeprefix("vllm:"))
    assert name in renamed

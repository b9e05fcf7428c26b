"""What /openapi.json says beyond FastAPI's defaults, so that it is a contract clients (and
schemathesis) can hold the server to: every status a route answers with OpenAI's error body,
the media types of /metrics and of streams, and the served model's token-id range."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.entrypoints.openai.protocol import (
    CROSS_FIELD_RULES,
    TOKEN_ID_MARK,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    OpenAIModel,
)


class HealthResponse(OpenAIModel):
    status: str  # "ok"


class VersionResponse(OpenAIModel):
    version: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_RULES = "; ".join(f"`{code}`: {text}" for code, text in CROSS_FIELD_RULES.items())
# Statuses any route may answer (the API key and body-size checks run before routing).
ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error(
        "Invalid request: a field outside its schema (``param`` names it), a body that is "
        f"not JSON, or one of the rules that tie fields together, named by ``code`` ({_RULES})."
    ),
    413: _error("The request body is larger than the server's limit."),
}
MODEL_RESPONSES = {**ERRORS, 404: _error("The model does not exist (code `model_not_found`).")}
GENERATION_ERRORS = {
    **MODEL_RESPONSES,
    500: _error("The engine failed while running the request."),
    503: _error("The engine is overloaded (`server_overloaded`) or dead (`engine_dead`)."),
}


def _sse(chunk: str) -> dict[str, Any]:
    """With ``stream: true``: events whose data is a chunk (or an error) as JSON, then
    ``[DONE]``. The schema describes one event, as OpenAPI 3.1 reads it for event streams."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{chunk}"},
                {"$ref": "#/components/schemas/ErrorResponse"},
            ]
        },
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }
    return {"text/event-stream": {"schema": event}}


COMPLETION_RESPONSES = {
    200: {
        "model": CompletionResponse,
        "description": "The completion",
        "content": _sse("CompletionResponse"),
    },
    **GENERATION_ERRORS,
}
CHAT_RESPONSES = {
    200: {
        "model": ChatCompletionResponse,
        "description": "The chat completion",
        "content": _sse("ChatCompletionChunk"),
    },
    **GENERATION_ERRORS,
}


def _responses_events() -> dict[str, Any]:
    """The Responses API's stream: events named by their type, data a JSON object."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
    }
    return {"text/event-stream": {"schema": event}}


RESPONSES_RESPONSES = {
    200: {
        "description": "The response object (OpenAI's Response), or its events with "
        "stream: true (response.created ... response.completed)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            **_responses_events(),
        },
    },
    **GENERATION_ERRORS,
}
RESPONSE_RETRIEVE = {
    200: {
        "description": "A stored response",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    404: _error("No stored response has this id (code `response_not_found`)."),
}
HEALTH_RESPONSES = {
    200: {"model": HealthResponse, "description": "The engine serves requests."},
    503: _error("The engine died; the server is stopping."),
}
METRICS_RESPONSES = {
    200: {
        "description": "Prometheus text exposition",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    **ERRORS,
}


def install_openapi(app: FastAPI, vocab_size: int, open_paths: list[str] | None) -> None:
    """Make ``app.openapi()`` the contract: 400 (not FastAPI's 422) for invalid bodies, the
    token-id maximum of this model, and 401 on the paths outside ``open_paths`` (None: no
    API key is wanted)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_422(schema)
            _set_token_id_maximum(schema, vocab_size - 1)
            if open_paths is not None:
                _add_api_key(schema, open_paths)
            _add_component(schema, ChatCompletionChunk)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_component(schema: dict[str, Any], model: type[OpenAIModel]) -> None:
    """model's JSON schema (and the models it uses) under components/schemas."""
    components = schema["components"]["schemas"]
    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in body.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components[model.__name__] = body


def _drop_422(schema: dict[str, Any]) -> None:
    """Invalid bodies are answered with 400 and OpenAI's error body, as OpenAI does."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)


def _set_token_id_maximum(node: Any, maximum: int) -> None:
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, False):
            node["maximum"] = maximum
        for value in node.values():
            _set_token_id_maximum(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_token_id_maximum(value, maximum)


def _add_api_key(schema: dict[str, Any], open_paths: list[str]) -> None:
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    unauthorized = {
        "description": "Missing or incorrect API key.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for route, path in schema.get("paths", {}).items():
        if route in open_paths:
            continue
        for operation in path.values():
            operation["security"] = [{"bearer": []}]
            operation["responses"]["401"] = unauthorized

"""Request fields that constrain the output -> StructuredOutputsParams.

OpenAI's ``response_format`` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}), vLLM's ``structured_outputs`` body field and
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` aliases.
At most one of them may be given. A malformed field is a 400 naming it (code
invalid_output_constraint).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.serving import constraint_error
from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _build(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise constraint_error(str(e).replace("structured_outputs", param), param=param) from e


def from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise constraint_error("response_format must be an object.", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise constraint_error(
                "response_format.json_schema must be an object with a `schema` object.",
                param="response_format",
            )
        # OpenAI lets `schema` be omitted: then any JSON object will do.
        if "schema" not in spec:
            return _build("response_format", json_object=True)
        return _build("response_format", json=spec["schema"])
    raise constraint_error(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}.",
        param="response_format",
    )


def from_request(req: Any) -> StructuredOutputsParams | None:
    """The one constraint a request asks for (None: free text); a 400 on conflicts."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = from_response_format(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(("response_format", fmt))
    body = getattr(req, "structured_outputs", None)
    if body is not None:
        if not isinstance(body, dict):
            raise constraint_error(
                "structured_outputs must be an object.", param="structured_outputs"
            )
        found.append(("structured_outputs", _build("structured_outputs", **body)))
    for alias, field in _GUIDED.items():
        value = getattr(req, alias, None)
        if value is not None:
            found.append((alias, _build(alias, **{field: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise constraint_error(f"give only one output constraint, got {names}.", param=found[1][0])
    return found[0][1] if found else None


async def precompile(engine: AsyncLLMEngine, constraint: StructuredOutputsParams | None) -> None:
    """Compile off the engine thread: the compiler caches the result, so a large schema
    does not hold up the steps of the streams already running. Errors are 400s."""
    if constraint is None:
        return
    try:
        await asyncio.to_thread(engine.engine.structured.compile, constraint)
    except ValueError as e:
        raise constraint_error(str(e)) from e

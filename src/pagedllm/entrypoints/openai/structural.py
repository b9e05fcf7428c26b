"""Output constraints as xgrammar structural-tag formats, so that they can be composed: a
constraint after the reasoning, tool calls inside free text, both at once.

A ``Format`` is the JSON of one xgrammar structural-tag format ({"type": "json_schema", ...},
{"type": "sequence", "elements": [...]}, ...); ``as_params`` wraps one as the
``structural_tag`` constraint the engine compiles.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

Format = dict[str, Any]

# Free whitespace between JSON tokens, as the engine allows for a plain JSON constraint;
# "compact" JSON gets the least a structural tag can say (xgrammar wants a positive count).
JSON_WHITESPACE = 16
COMPACT_WHITESPACE = 1


def json_format(schema: dict[str, Any] | bool, compact: bool = False) -> Format:
    """A JSON document of the schema (length-bounded strings as the engine writes them)."""
    from pagedllm.structured_output.backend import bounded_strings_as_patterns, check_json_schema

    check_json_schema(schema)
    return {
        "type": "json_schema",
        "json_schema": bounded_strings_as_patterns(schema),
        "max_whitespace_cnt": COMPACT_WHITESPACE if compact else JSON_WHITESPACE,
    }


def constraint_format(params: StructuredOutputsParams) -> Format | None:
    """The format of one constraint; None for a structural tag in xgrammar's older shape
    (triggers + structures), which cannot be nested."""
    kind = params.kind
    if kind == "json":
        return json_format(params.schema_dict(), params.disable_any_whitespace)
    if kind == "json_object":
        return json_format({"type": "object"}, params.disable_any_whitespace)
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "choice":
        return {
            "type": "or",
            "elements": [{"type": "const_string", "value": c} for c in params.choice or []],
        }
    if kind == "grammar":
        return {"type": "grammar", "grammar": params.grammar}
    try:
        tag = json.loads(params.structural_tag or "")
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}.") from e
    return tag.get("format") if isinstance(tag, dict) else None


def as_params(fmt: Format) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        structural_tag=json.dumps({"type": "structural_tag", "format": fmt})
    )

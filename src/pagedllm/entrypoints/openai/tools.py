"""Tool calling on chat completions: tools + tool_choice -> a constraint and a parser.

"none" hides nothing but calls nothing; "auto" lets the model write calls in its own format,
which the ``--tool-call-parser`` turns into tool_calls; "required" and a named function
constrain the output with a JSON schema built from the functions' parameter schemas (as vLLM
does), so the calls parse and their arguments validate:
    named function -> the output is that function's arguments object;
    "required"     -> the output is a JSON array of {"name": ..., "parameters": {...}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.serving import constraint_error
from pagedllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamedDelta,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import json_value_end
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


def parse_tools(tools: list[Any] | None) -> list[FunctionSpec]:
    """The functions of a ``tools`` list; a 400 naming what is malformed."""
    specs: list[FunctionSpec] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise constraint_error(f"tools[{i}] must be a function tool.", param="tools")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise constraint_error(f"tools[{i}].function needs a name.", param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise constraint_error(
                f"tools[{i}].function.parameters must be an object.", param="tools"
            )
        specs.append(FunctionSpec(fn["name"], params))
    return specs


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates expect them (OpenAI's shape, plain dicts)."""
    return [dict(t) for t in tools] if tools else None


@dataclass(frozen=True)
class ToolMode:
    """How a chat request treats tools."""

    kind: str  # "none" | "auto" | "required" | "named"
    functions: tuple[FunctionSpec, ...] = ()
    named: str | None = None  # the function of "named"

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of "required" / a named function; compact JSON, since programs
        read the arguments and free whitespace only costs tokens."""
        if self.kind == "named":
            fn = next(f for f in self.functions if f.name == self.named)
            return StructuredOutputsParams(json=fn.parameters, disable_any_whitespace=True)
        if self.kind == "required":
            schema = required_schema(self.functions)
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None


def required_schema(functions: tuple[FunctionSpec, ...]) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a function and valid arguments."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "parameters": f.parameters},
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def tool_mode(tools: list[Any] | None, tool_choice: Any) -> ToolMode:
    functions = tuple(parse_tools(tools))
    if tool_choice is None:
        return ToolMode("auto" if functions else "none", functions)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise constraint_error(f'tool_choice "{tool_choice}" needs tools.', param="tool_choice")
        return ToolMode(tool_choice, functions)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in {f.name for f in functions}:
                raise constraint_error(
                    f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
                )
            return ToolMode("named", functions, name)
    raise constraint_error(
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}}.',
        param="tool_choice",
    )


def _complete_elements(text: str) -> list[dict[str, Any]]:
    """The complete objects of a (possibly unfinished) JSON array of objects."""
    start = text.find("[")
    elements: list[dict[str, Any]] = []
    pos = start + 1 if start >= 0 else len(text)
    while pos < len(text):
        if text[pos] in " \t\r\n,":
            pos += 1
            continue
        if text[pos] != "{":
            break
        end = json_value_end(text, pos)
        if end is None:
            break
        elements.append(json.loads(text[pos:end]))
        pos = end
    return elements


class ConstrainedToolParser(ToolParser):
    """Reads the output of "required" / a named function, which the grammar shaped."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._id = new_tool_call_id()
        self._sent = 0
        self._done = False

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.mode.kind == "named":
            return ExtractedToolCalls([ParsedToolCall(self.mode.named or "", text, self._id)], None)
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens: report the text
            return ExtractedToolCalls([], text)
        return ExtractedToolCalls(
            [
                ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in calls
            ],
            None,
        )

    def stream(self, text: str, finished: bool) -> StreamedDelta:
        out = StreamedDelta()
        if self.mode.kind == "named":
            # The output is the arguments themselves: stream them as they come.
            if self._sent == 0 and not self._done:
                out.tool_calls.append(ToolCallDelta(0, self._id, self.mode.named))
                self._done = True
            piece = text[self._sent :]
            if piece:
                self._sent = len(text)
                if out.tool_calls:
                    out.tool_calls[0].arguments = piece
                else:
                    out.tool_calls.append(ToolCallDelta(0, arguments=piece))
            return out
        # "required": each call of the array is sent once its object is complete.
        calls = _complete_elements(text)
        for i in range(self._sent, len(calls)):
            call = calls[i]
            args = json.dumps(call["parameters"], ensure_ascii=False)
            out.tool_calls.append(ToolCallDelta(i, new_tool_call_id(), call["name"], args))
        self._sent = len(calls)
        if finished and not self._sent:  # cut short before a call was complete
            out.content = text
        return out

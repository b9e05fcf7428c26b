"""Tool calling on chat completions: tools + tool_choice -> a constraint and a parser.

"none" hides nothing but calls nothing; "auto" lets the model write calls in its own format,
which the ``--tool-call-parser`` turns into tool_calls; "required" and a named function
constrain the output with a JSON schema built from the functions' parameter schemas (as vLLM
does), so the calls parse and their arguments validate:
    named function -> the output is that function's arguments object;
    "required"     -> the output is a JSON array of {"name": ..., "parameters": {...}}
                      (of one element when parallel_tool_calls is false).
In "auto" the text is free until the parser's call marker (``<tool_call>``); from there the
grammar admits only a declared function with valid arguments, and after the first call
nothing more when parallel_tool_calls is false. Where no grammar applies (a request that
brings its own output constraint), calls of undeclared functions are dropped with a warning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
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

logger = logging.getLogger(__name__)


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
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

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
            schema = required_schema(self.functions, self.parallel)
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None


def call_schemas(functions: tuple[FunctionSpec, ...], arguments_key: str) -> list[dict[str, Any]]:
    """One schema per function: an object naming it and holding valid arguments."""
    return [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
            "required": ["name", arguments_key],
        }
        for f in functions
    ]


def required_schema(functions: tuple[FunctionSpec, ...], parallel: bool = True) -> dict[str, Any]:
    """A JSON array of one or more calls (exactly one unless parallel), each naming a
    function and valid arguments."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": call_schemas(functions, "parameters")},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_mode(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None = None
) -> ToolMode:
    functions = tuple(parse_tools(tools))
    parallel = parallel_tool_calls is not False  # OpenAI's default: parallel calls allowed
    if tool_choice is None:
        return ToolMode("auto" if functions else "none", functions, parallel=parallel)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise constraint_error(f'tool_choice "{tool_choice}" needs tools.', param="tool_choice")
        return ToolMode(tool_choice, functions, parallel=parallel)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in {f.name for f in functions}:
                raise constraint_error(
                    f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
                )
            return ToolMode("named", functions, name, parallel)
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
        except json.JSONDecodeError:
            # Cut short by max_tokens: the calls that are complete are still calls (the
            # finish reason says "length"); with none complete the text is all there is.
            calls = _complete_elements(text)
            if not calls:
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


@dataclass
class DeclaredCallsOnly(ToolParser):
    """A parser's calls, less those of undeclared functions and, unless parallel calls are
    allowed, all but the first. A grammar rules these out where one applies; this is the
    rule where none does (the request brought its own output constraint)."""

    inner: ToolParser
    mode: ToolMode
    _kept: dict[int, int | None] = field(default_factory=dict)  # inner index -> ours

    def _keep(self, name: str, count: int) -> bool:
        if name not in self.mode.names:
            logger.warning("dropped a call of %r, a function the request did not declare", name)
            return False
        if count >= 1 and not self.mode.parallel:
            logger.warning("dropped a second tool call: parallel_tool_calls is false")
            return False
        return True

    def extract(self, text: str) -> ExtractedToolCalls:
        extracted = self.inner.extract(text)
        calls: list[ParsedToolCall] = []
        for call in extracted.tool_calls:
            if self._keep(call.name, len(calls)):
                calls.append(call)
        return ExtractedToolCalls(calls, extracted.content)

    def stream(self, text: str, finished: bool) -> StreamedDelta:
        delta = self.inner.stream(text, finished)
        kept: list[ToolCallDelta] = []
        for piece in delta.tool_calls:
            if piece.index not in self._kept:  # a call's first delta names its function
                count = sum(v is not None for v in self._kept.values())
                self._kept[piece.index] = count if self._keep(piece.name or "", count) else None
            ours = self._kept[piece.index]
            if ours is not None:
                piece.index = ours
                kept.append(piece)
        return StreamedDelta(delta.content, kept)

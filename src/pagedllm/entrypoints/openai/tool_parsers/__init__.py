"""Tool-call parsers: turn a model's text into OpenAI tool calls, chosen by
``--tool-call-parser`` (vLLM's names). Registered by name and imported lazily."""

from __future__ import annotations

import importlib

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamedDelta,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)

_PARSERS = {
    "hermes": "pagedllm.entrypoints.openai.tool_parsers.hermes:HermesToolParser",
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under name; ValueError for an unknown one."""
    if name not in _PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(tool_parser_names())}, got {name!r}."
        )
    module, cls = _PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = [
    "ExtractedToolCalls",
    "ParsedToolCall",
    "StreamedDelta",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
    "tool_parser_names",
]

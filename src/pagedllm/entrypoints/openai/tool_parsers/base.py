"""The tool-parser interface and the data it returns."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ExtractedToolCalls:
    """A finished output split into its text and its tool calls."""

    tool_calls: list[ParsedToolCall]
    content: str | None  # the text outside the calls; None when there is none

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call, as OpenAI's delta.tool_calls[i]."""

    index: int  # which call of the message
    id: str | None = None  # only on the call's first delta
    name: str | None = None  # only on the call's first delta
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclass
class StreamedDelta:
    content: str = ""  # text to stream as content
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolParser(ABC):
    """Parses one choice's output. One instance per choice: streaming keeps state."""

    @classmethod
    def call_format(cls, calls: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        """The grammar of free text with calls in this parser's format, as an xgrammar
        structural-tag format: ``calls`` are JSON schemas of {"name", "arguments"} objects
        (one per declared function); with ``parallel`` false, nothing may follow the first
        call. None: the format cannot be written as a grammar (calls are then filtered)."""
        return None

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The tool calls in a complete output."""

    @abstractmethod
    def stream(self, text: str, finished: bool) -> StreamedDelta:
        """What to send now, given the whole output text so far (finished: no more comes).

        The content and argument pieces sent over all calls concatenate to exactly what
        `extract` returns for the final text.
        """

"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2 Pro, Qwen2.5 / Qwen3 and others whose chat templates list the tools
in the system prompt. Text before the first call is the message's content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamedDelta,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """End index of the object / array that starts at text[start] (None: not closed yet)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class _StreamedCall:
    name_sent: bool = False
    args_sent: int = 0  # characters of the arguments' text sent


class HermesToolParser(ToolParser):
    @classmethod
    def call_format(cls, calls: list[dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
        # Templates write "<tool_call>\n{...}\n</tool_call>"; the newlines are optional so
        # that a model trained on either spacing keeps its own.
        body = {
            "type": "sequence",
            "elements": [
                {"type": "regex", "pattern": r"\n?"},
                {"type": "json_schema", "json_schema": {"anyOf": calls}, "max_whitespace_cnt": 4},
                {"type": "regex", "pattern": r"\n?"},
            ],
        }
        return {
            "type": "triggered_tags",
            "triggers": [START],
            "tags": [{"type": "tag", "begin": START, "content": body, "end": END}],
            "stop_after_first": not parallel,
        }

    def __init__(self) -> None:
        self._content_sent = 0
        self._calls: list[_StreamedCall] = []

    # ---- a finished output ---------------------------------------------------------------
    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(START)
        if first < 0:
            return ExtractedToolCalls([], text)
        calls: list[ParsedToolCall] = []
        for body, _ in self._blocks(text, first):
            call = self._parse_block(body)
            if call is None:  # not a well-formed call: the whole output is text
                return ExtractedToolCalls([], text)
            calls.append(call)
        content = text[:first]
        return ExtractedToolCalls(calls, content if content.strip() else None)

    @staticmethod
    def _blocks(text: str, first: int) -> list[tuple[str, bool]]:
        """(body, closed) of each call from the first START on."""
        blocks = []
        pos = first
        while pos >= 0:
            body_start = pos + len(START)
            end = text.find(END, body_start)
            if end < 0:
                blocks.append((text[body_start:], False))
                break
            blocks.append((text[body_start:end], True))
            pos = text.find(START, end + len(END))
        return blocks

    @staticmethod
    def _parse_block(body: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        m = _ARGS.search(body)
        end = json_value_end(body, m.end()) if m and body[m.end() : m.end() + 1] in "{[" else None
        # The arguments as the model wrote them, so streamed pieces add up to the same text.
        raw = body[m.end() : end] if m and end else json.dumps(args, ensure_ascii=False)
        return ParsedToolCall(obj["name"], raw)

    # ---- streaming -----------------------------------------------------------------------
    def stream(self, text: str, finished: bool) -> StreamedDelta:
        out = StreamedDelta()
        first = text.find(START)
        content_end = len(text) if first < 0 else first
        if first < 0 and not finished:
            content_end -= _held_back(text, START)
        if content_end > self._content_sent:
            out.content = text[self._content_sent : content_end]
            self._content_sent = content_end
        if first < 0:
            return out
        if finished:
            return self._finish(text, out)
        for index, (body, _) in enumerate(self._blocks(text, first)):
            self._stream_call(index, body, out)
        return out

    def _stream_call(self, index: int, body: str, out: StreamedDelta) -> None:
        if index == len(self._calls):
            m = _NAME.search(body)
            if m is None:
                return
            self._calls.append(_StreamedCall(name_sent=True))
            name = json.loads(f'"{m.group(1)}"')
            out.tool_calls.append(ToolCallDelta(index, new_tool_call_id(), name))
        state = self._calls[index]
        m = _ARGS.search(body)
        if m is None or body[m.end() : m.end() + 1] not in ("{", "["):
            return
        end = json_value_end(body, m.end()) or len(body)
        piece = body[m.end() + state.args_sent : end]
        if piece:
            state.args_sent += len(piece)
            self._add_arguments(out, index, piece)

    def _finish(self, text: str, out: StreamedDelta) -> StreamedDelta:
        """The last delta: whatever the complete parse has that was not sent yet."""
        extracted = self.extract(text)
        if not extracted.tools_called:  # the "calls" were not well formed: send the text
            out.content += text[self._content_sent :]
            self._content_sent = len(text)
            return out
        for index, call in enumerate(extracted.tool_calls):
            if index == len(self._calls):
                self._calls.append(_StreamedCall(name_sent=True))
                out.tool_calls.append(ToolCallDelta(index, call.id, call.name))
            state = self._calls[index]
            piece = call.arguments[state.args_sent :]
            if piece:
                state.args_sent += len(piece)
                self._add_arguments(out, index, piece)
        return out

    @staticmethod
    def _add_arguments(out: StreamedDelta, index: int, piece: str) -> None:
        if out.tool_calls and out.tool_calls[-1].index == index:
            out.tool_calls[-1].arguments += piece
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=piece))

"""/v1/responses: OpenAI's Responses API on top of the chat handler.

A request becomes a chat request (``instructions`` a system message, ``input`` text or
items: messages, earlier ``function_call`` items and their ``function_call_output``; tools
flattened as Responses writes them; ``text.format`` as response_format), runs as one, and
its choice becomes output items: ``reasoning`` (with a reasoning parser), ``message``
(output_text) and ``function_call``. Streams send the Responses event types (created,
in_progress, output_item.added, content_part.added, output_text.delta, ..., completed).

Stored responses (``store``, the default) keep their conversation, so that
``previous_response_id`` continues it; the store holds the newest ``max_stored`` and forgets
the oldest (in memory: a restart forgets all).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    ChatStreamChoice,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessageItem,
    ResponsesRequest,
)
from pagedllm.entrypoints.openai.serving import (
    DeltaTracker,
    ServingError,
    choose_output_kind,
    collect_finals,
    error_event,
    event_stream,
    unless_disconnected,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat

DEFAULT_MAX_STORED = 1000


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseStore:
    """The newest stored responses: each one's conversation (chat messages, its output
    included) and the response object itself."""

    max_stored: int = DEFAULT_MAX_STORED
    _items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = field(
        default_factory=OrderedDict
    )

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (messages, response)
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(
        self, response_id: str, param: str | None = "previous_response_id"
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        try:
            return self._items[response_id]
        except KeyError:
            raise ServingError(
                f"no stored response with id {response_id!r}.",
                status=404,
                param=param,
                code="response_not_found",
            ) from None

    def __len__(self) -> int:
        return len(self._items)


# ---- request -> chat request ---------------------------------------------------------------
def _text_of(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (consecutive calls form one assistant turn)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, InputMessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": _arguments(item.arguments)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _arguments(text: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ServingError(
            f"a function_call item's arguments are not JSON: {e}",
            param="input",
            code="invalid_function_arguments",
        ) from e
    return text


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name or "output"}
    if fmt.schema_ is not None:
        spec["schema"] = fmt.schema_
    return {"type": "json_schema", "json_schema": spec}


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    messages = list(history)
    if req.instructions:  # instructions belong to this response only (not carried on)
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req)
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in req.tools or []
    ]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _tool_choice(req) if tools else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    return ChatCompletionRequest.model_validate(body, strict=False)


# ---- output items --------------------------------------------------------------------------
def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": "completed",
    }


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = []
    if text is not None:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant's chat turn (for the next response)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id, param=None)[1]

    async def create(
        self, req: ResponsesRequest, raw: Request
    ) -> dict[str, Any] | StreamingResponse:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id)[0]
        chat_req = chat_request(req, history)
        prep = await self.chat.prepare(chat_req, raw)
        response_id = _id("resp")
        choose_output_kind(prep.params, bool(req.stream))
        (stream,) = await self.chat.add_requests(
            response_id, [(prep.prompt, prep.params)], chat_req.model
        )
        base = self._base(req, response_id)
        # What previous_response_id continues: the conversation without this turn's
        # instructions (they apply to this response only), then its output.
        conversation = chat_req.model_dump(exclude_none=True)["messages"]
        if req.instructions:
            conversation = conversation[1:]
        if req.stream:
            events = self._events(req, prep, stream, base, conversation)
            return event_stream(events, [stream])
        (final,) = await unless_disconnected(collect_finals([stream]), raw)
        comp = final.outputs[0]
        incomplete = comp.finish_reason == "length"
        output = self._output_items(self.chat.choice(comp, prep).message, incomplete)
        usage = _usage(len(final.prompt_token_ids), len(comp.token_ids))
        response = self._finish(base, output, incomplete, usage)
        self._keep(req, response, conversation)
        return response

    @staticmethod
    def _output_items(message: ChatResponseMessage, incomplete: bool) -> list[dict[str, Any]]:
        """A finished chat message as output items: reasoning, message, function calls."""
        output: list[dict[str, Any]] = []
        if message.reasoning_content:
            output.append(_reasoning_item(_id("rs"), message.reasoning_content))
        if message.content is not None or not message.tool_calls:
            status = "incomplete" if incomplete else "completed"
            output.append(_message_item(_id("msg"), message.content or "", status))
        for call in message.tool_calls or []:
            output.append(
                _call_item(_id("fc"), call.id, call.function.name, call.function.arguments)
            )
        return output

    def _keep(
        self, req: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> None:
        if req.store:
            self.store.put(response, conversation + output_messages(response["output"]))

    def _base(self, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if (req.text is not None and req.text.format is not None)
            else {"type": "text"}
        )
        tool_choice = req.tool_choice
        if tool_choice is not None and not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.chat.response_model(req.model),
            "status": "in_progress",
            "output": [],
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt},
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "store": req.store,
            "metadata": req.metadata or {},
            "incomplete_details": None,
            "error": None,
            "usage": None,
        }

    @staticmethod
    def _finish(
        base: dict[str, Any], output: list[dict[str, Any]], incomplete: bool, usage: dict[str, Any]
    ) -> dict[str, Any]:
        response = dict(base, output=output, usage=usage)
        response["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["completed_at"] = None if incomplete else int(time.time())
        return response

    async def _events(
        self,
        req: ResponsesRequest,
        prep: PreparedChat,
        stream: RequestStream,
        base: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        writer = _EventWriter()
        yield writer.event("response.created", response=base)
        yield writer.event("response.in_progress", response=base)
        tracker = DeltaTracker()
        finish: str | None = None
        try:
            async for choice in self.chat.stream_choices(prep, stream, tracker):
                for event in writer.delta(choice):
                    yield event
                finish = choice.finish_reason or finish
        except Exception as e:  # the stream has begun: the error is an event
            yield error_event(e).replace("data: ", "event: error\ndata: ", 1)
            return
        incomplete = finish == "length"
        for event in writer.close(incomplete):
            yield event
        usage = _usage(tracker.prompt_tokens, tracker.completion_tokens.get(0, 0))
        response = self._finish(base, writer.output, incomplete, usage)
        self._keep(req, response, conversation)
        kind = "response.incomplete" if incomplete else "response.completed"
        yield writer.event(kind, response=response)


class _EventWriter:
    """Turns chat deltas into Responses events, opening and closing output items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" | "message" | "call" | None
        self.call_index: int | None = None  # the streamed call the open item is

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    @property
    def index(self) -> int:
        return len(self.output) - 1

    def _item_fields(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": self.index}

    def delta(self, choice: ChatStreamChoice) -> list[str]:
        events: list[str] = []
        delta = choice.delta
        if delta.reasoning_content:
            if self.open != "reasoning":
                events += self.close_item()
                item = _reasoning_item(_id("rs"), "")
                item["status"] = "in_progress"
                events += self._add(item, "reasoning")
                item["content"] = [{"type": "reasoning_text", "text": ""}]
            self.output[-1]["content"][0]["text"] += delta.reasoning_content
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    content_index=0,
                    delta=delta.reasoning_content,
                    **self._item_fields(),
                )
            )
        if delta.content:
            if self.open != "message":
                events += self.close_item()
                events += self._open_message()
            self.output[-1]["content"][0]["text"] += delta.content
            events.append(
                self.event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                    **self._item_fields(),
                )
            )
        for call in delta.tool_calls or []:
            if self.open != "call" or self.call_index != call.index:
                events += self.close_item()
                item = _call_item(_id("fc"), call.id or _id("call"), call.function.name or "", "")
                item["status"] = "in_progress"
                events += self._add(item, "call")
                self.call_index = call.index
            piece = call.function.arguments or ""
            if piece:
                self.output[-1]["arguments"] += piece
                events.append(
                    self.event(
                        "response.function_call_arguments.delta", delta=piece, **self._item_fields()
                    )
                )
        return events

    def _add(self, item: dict[str, Any], kind: str) -> list[str]:
        self.output.append(item)
        self.open = kind
        return [
            self.event(
                "response.output_item.added",
                output_index=self.index,
                item=dict(item, content=[]) if "content" in item else item,
            )
        ]

    def _open_message(self) -> list[str]:
        item = _message_item(_id("msg"), None, "in_progress")
        events = self._add(item, "message")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"] = [part]
        events.append(
            self.event(
                "response.content_part.added",
                content_index=0,
                part=dict(part),
                **self._item_fields(),
            )
        )
        return events

    def close_item(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        item = self.output[-1]
        fields = self._item_fields()
        events: list[str] = []
        if self.open == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event("response.reasoning_text.done", content_index=0, text=text, **fields)
            )
        elif self.open == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                    **fields,
                )
            )
            events.append(
                self.event("response.content_part.done", content_index=0, part=part, **fields)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", arguments=item["arguments"], **fields
                )
            )
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.open = None
        return events

    def close(self, incomplete: bool) -> list[str]:
        """The last item's end; a response with no output gets an empty message."""
        events = []
        if not self.output:
            events += self._open_message()
        return events + self.close_item("incomplete" if incomplete else "completed")

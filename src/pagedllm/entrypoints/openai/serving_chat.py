"""/v1/chat/completions: the conversation rendered by the chat template, n choices.

Output constraints (response_format, structured_outputs) and tools: "required" and a named
function constrain the output (tools.py); "auto" parses it with the server's tool parser,
whose call format the grammar enforces once a call starts. With a reasoning parser the
``<think>`` block goes to ``reasoning_content`` and the constraint applies after it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.core.outputs import CompletionOutput, TokenLogprobs
from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedllm.entrypoints.openai.serving import (
    ChunkHeader,
    DeltaTracker,
    OpenAIServing,
    ServedModel,
    add_warning,
    constraint_error,
    merge_streams,
    sse,
    streamed_usage,
    top_entries,
    usage_info,
)
from pagedllm.entrypoints.openai.structural import Format, as_params, constraint_format
from pagedllm.entrypoints.openai.structured import from_request as structured_from_request
from pagedllm.entrypoints.openai.structured import precompile
from pagedllm.entrypoints.openai.tool_parsers import StreamedDelta, ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tools import (
    ConstrainedToolParser,
    DeclaredCallsOnly,
    ToolMode,
    call_schemas,
    template_tools,
    tool_mode,
)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
TOOLS_IGNORED = (
    "the chat template ignores `tools`: the prompt does not list them (start the server "
    "with --chat-template, e.g. chatml_tools, to give the model the tools)"
)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model: ServedModel,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(engine, model)
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    async def prepare(self, req: ChatCompletionRequest, raw: Request) -> PreparedChat:
        """Everything a chat request needs before it runs (the Responses API shares it)."""
        self.check_model(req.model)
        mode = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls)
        top = self._top_logprobs(req)
        tools = template_tools(req.tools)
        text = self.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools
        )
        if tools and mode.kind != "none" and self._template_ignores_tools(req, text):
            logger.warning(TOOLS_IGNORED)
            add_warning(raw, TOOLS_IGNORED)
        constraint = self._constraint(req, mode, text)
        ids = self.encode(text, add_special=False, param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
        params = self.sampling_params(
            req, len(ids), max_tokens, top, "messages", structured_outputs=constraint
        )
        await precompile(self.engine, constraint)
        prompt = {"prompt": text, "prompt_token_ids": ids}
        return PreparedChat(req, mode, top, text, prompt, params)

    async def create(
        self, req: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        """The response, or for ``stream: true`` the server-sent events to send."""
        prep = await self.prepare(req, raw)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        header = ChunkHeader(request_id, self.response_model(req.model))
        result = await self.respond(
            raw,
            request_id,
            [(prep.prompt, prep.params)],
            req.stream,
            lambda streams: self._stream(prep, header, streams[0]),
            req.model,
        )
        if isinstance(result, StreamingResponse):
            return result
        (final,) = result
        choices = [self.choice(comp, prep) for comp in final.outputs]
        return ChatCompletionResponse(
            id=request_id, model=header.model, choices=choices, usage=usage_info([final])
        )

    def _template_ignores_tools(self, req: ChatCompletionRequest, with_tools: str) -> bool:
        """Whether the prompt is the same without the tools (the template drops them)."""
        without = self.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs, None
        )
        return without == with_tools

    def _constraint(
        self, req: ChatCompletionRequest, mode: ToolMode, prompt: str
    ) -> StructuredOutputsParams | None:
        """The request's output constraint: the tools' or its own, after the reasoning."""
        constraint = structured_from_request(req)
        tool_format: Format | None = None
        if mode.constrained:
            if constraint is not None:
                raise constraint_error(
                    f"tool_choice {mode.kind} cannot be combined with another output "
                    "constraint (response_format, structured_outputs).",
                    param="tool_choice",
                )
            constraint = mode.structured_outputs()
        elif mode.kind == "auto":
            if self.tool_parser_cls is None:
                raise constraint_error(
                    'tool_choice "auto" needs the server started with --tool-call-parser; '
                    'use "required", a named function or "none".',
                    param="tool_choice",
                )
            if constraint is None:  # with its own constraint the calls are filtered instead
                calls = call_schemas(mode.functions, "arguments")
                tool_format = self.tool_parser_cls.call_format(calls, mode.parallel)
        return self._after_reasoning(req, prompt, constraint, tool_format)

    def _after_reasoning(
        self,
        req: ChatCompletionRequest,
        prompt: str,
        constraint: StructuredOutputsParams | None,
        tool_format: Format | None,
    ) -> StructuredOutputsParams | None:
        budget = req.thinking_token_budget
        if self.reasoning_cls is None:
            if budget is not None:
                raise constraint_error(
                    "thinking_token_budget needs the server started with --reasoning-parser.",
                    param="thinking_token_budget",
                )
            return as_params(tool_format) if tool_format is not None else constraint
        fmt = tool_format
        try:
            if fmt is None and constraint is not None:
                fmt = constraint_format(constraint)
                if fmt is None:  # a structural tag of the older shape: applies from the start
                    return constraint
        except ValueError as e:
            raise constraint_error(str(e)) from e
        whole = self.reasoning_cls(prompt).constrain_after(fmt, budget)
        return as_params(whole) if whole is not None else None

    def _parser(self, mode: ToolMode) -> ToolParser | None:
        """A fresh parser for one choice (None: the output is plain content)."""
        if mode.constrained:
            return ConstrainedToolParser(mode)
        if mode.kind == "auto" and self.tool_parser_cls is not None:
            return DeclaredCallsOnly(self.tool_parser_cls(), mode)
        return None

    def _reasoning(self, prompt: str) -> ReasoningParser | None:
        return self.reasoning_cls(prompt) if self.reasoning_cls is not None else None

    @staticmethod
    def _finish_reason(reason: str | None, mode: ToolMode, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named function ends in "stop".
        if reason == "stop" and called and mode.kind != "named":
            return "tool_calls"
        return reason

    def choice(self, comp: CompletionOutput, prep: PreparedChat) -> ChatChoice:
        """One finished choice: its content, reasoning and tool calls."""
        top, mode = prep.top, prep.mode
        text: str | None = comp.text
        reasoning = None
        rparser = self._reasoning(prep.text)
        if rparser is not None:
            split = rparser.split(comp.text, finished=True)
            text, reasoning = split.content, split.reasoning or None
        message = ChatResponseMessage(content=text, reasoning_content=reasoning)
        parser = self._parser(mode)
        called = False
        if parser is not None and text is not None:
            extracted = parser.extract(text)
            called = extracted.tools_called
            message = ChatResponseMessage(
                content=extracted.content,
                reasoning_content=reasoning,
                tool_calls=[
                    ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in extracted.tool_calls
                ]
                or None,
            )
        return ChatChoice(
            index=comp.index,
            message=message,
            logprobs=self.logprobs(comp.token_ids, comp.logprobs, top)
            if top is not None and comp.logprobs is not None
            else None,
            finish_reason=self._finish_reason(comp.finish_reason, mode, called),
        )

    @staticmethod
    def _top_logprobs(req: ChatCompletionRequest) -> int | None:
        """SamplingParams.logprobs for a chat request: None unless ``logprobs`` is true."""
        # top_logprobs without logprobs asks for nothing (the schema says so)
        return (req.top_logprobs or 0) if req.logprobs else None

    def logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs], top: int
    ) -> ChatChoiceLogprobs:
        """OpenAI's chat logprobs: per token its text, bytes, logprob and the top alternatives."""
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            alternatives = [
                TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                for t, lp in ((self.token_text(i), lp) for i, lp in top_entries(entry, top))
            ]
            content.append(
                TokenLogprob(
                    token=text,
                    logprob=entry[token_id].logprob,
                    bytes=list(text.encode()),
                    top_logprobs=alternatives,
                )
            )
        return ChatChoiceLogprobs(content=content)

    async def _stream(
        self, prep: PreparedChat, header: ChunkHeader, stream: RequestStream
    ) -> AsyncIterator[str]:
        req = prep.req

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=header.id,
                    created=header.created,
                    model=header.model,
                    choices=choices,
                    usage=usage,
                )
            )

        for index in range(req.n):  # OpenAI opens every choice with the role
            yield chunk(
                [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
            )
        tracker = DeltaTracker()
        async for choice in self.stream_choices(prep, stream, tracker):
            yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], streamed_usage([tracker]))

    async def stream_choices(
        self, prep: PreparedChat, stream: RequestStream, tracker: DeltaTracker
    ) -> AsyncIterator[ChatStreamChoice]:
        """The streamed deltas of every choice, each choice ended by one with its
        finish_reason (``tracker`` counts the tokens, for the usage)."""
        n, top, mode = prep.req.n, prep.top, prep.mode
        splitters = {index: _ChoiceSplitter(self._reasoning(prep.text)) for index in range(n)}
        parsers = {index: self._parser(mode) for index in range(n)}
        called = dict.fromkeys(range(n), False)
        async for _, out in merge_streams([stream]):
            for d in tracker.update(out):
                logprobs = None
                if top is not None and d.logprobs is not None:
                    logprobs = self.logprobs(d.token_ids, d.logprobs, top)
                finished = d.finish_reason is not None
                reasoning, content = splitters[d.index].feed(d.text, finished)
                parser = parsers[d.index]
                parsed = StreamedDelta()
                if content is not None:
                    if parser is None:
                        parsed.content = splitters[d.index].content_piece(content)
                    else:
                        parsed = parser.stream(content, finished)
                called[d.index] |= bool(parsed.tool_calls)
                delta = _delta_message(parsed, reasoning) if parsed or reasoning else None
                if delta is not None or (logprobs is not None and logprobs.content):
                    yield ChatStreamChoice(
                        index=d.index, delta=delta or DeltaMessage(content=""), logprobs=logprobs
                    )
                if d.finish_reason is not None:
                    reason = self._finish_reason(d.finish_reason, mode, called[d.index])
                    yield ChatStreamChoice(
                        index=d.index, delta=DeltaMessage(), finish_reason=reason
                    )


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready to run: its tool mode, prompt and sampling parameters."""

    req: ChatCompletionRequest
    mode: ToolMode
    top: int | None  # SamplingParams.logprobs
    text: str  # the rendered prompt
    prompt: dict[str, Any]  # the engine's prompt (text and token ids)
    params: SamplingParams


class _ChoiceSplitter:
    """One streamed choice's text: its reasoning pieces and its content so far."""

    def __init__(self, reasoning: ReasoningParser | None) -> None:
        self.reasoning = reasoning
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, piece: str, finished: bool) -> tuple[str, str | None]:
        """(new reasoning text, the whole content so far or None while reasoning)."""
        self.text += piece
        if self.reasoning is None:
            return "", self.text
        split = self.reasoning.split(self.text, finished)
        new = split.reasoning[self.reasoning_sent :]
        self.reasoning_sent = len(split.reasoning)
        return new, split.content

    def content_piece(self, content: str) -> str:
        piece = content[self.content_sent :]
        self.content_sent = len(content)
        return piece


def _delta_message(parsed: StreamedDelta, reasoning: str = "") -> DeltaMessage:
    calls = [
        DeltaToolCall(
            index=tc.index,
            id=tc.id,
            type="function" if tc.id is not None else None,
            function=DeltaFunctionCall(name=tc.name, arguments=tc.arguments),
        )
        for tc in parsed.tool_calls
    ]
    return DeltaMessage(
        content=parsed.content or None,
        reasoning_content=reasoning or None,
        tool_calls=calls or None,
    )

"""/v1/chat/completions: the conversation rendered by the chat template, n choices.

Output constraints (response_format, structured_outputs) and tools: "required" and a named
function constrain the output (tools.py); "auto" parses it with the server's tool parser.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

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
from pagedllm.entrypoints.openai.serving import (
    ChunkHeader,
    DeltaTracker,
    OpenAIServing,
    ServedModel,
    constraint_error,
    merge_streams,
    sse,
    top_entries,
    usage_info,
)
from pagedllm.entrypoints.openai.structured import from_request as structured_from_request
from pagedllm.entrypoints.openai.structured import precompile
from pagedllm.entrypoints.openai.tool_parsers import StreamedDelta, ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tools import (
    ConstrainedToolParser,
    ToolMode,
    template_tools,
    tool_mode,
)
from pagedllm.sampling_params import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLMEngine, model: ServedModel, tool_call_parser: str | None = None
    ) -> None:
        super().__init__(engine, model)
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None

    async def create(
        self, req: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        """The response, or for ``stream: true`` the server-sent events to send."""
        self.check_model(req.model)
        mode = tool_mode(req.tools, req.tool_choice)
        constraint = self._constraint(req, mode)
        top = self._top_logprobs(req)
        text = self.render_chat(
            req.messages,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            template_tools(req.tools),
        )
        ids = self.encode(text, add_special=False, param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
        params = self.sampling_params(
            req, len(ids), max_tokens, top, "messages", structured_outputs=constraint
        )
        await precompile(self.engine, constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt": text, "prompt_token_ids": ids}
        header = ChunkHeader(request_id, self.model.name)
        result = await self.respond(
            raw,
            request_id,
            [(prompt, params)],
            req.stream,
            lambda streams: self._stream(req, header, streams[0], top, mode),
        )
        if isinstance(result, StreamingResponse):
            return result
        (final,) = result
        choices = [self._choice(comp, top, mode) for comp in final.outputs]
        return ChatCompletionResponse(
            id=request_id, model=self.model.name, choices=choices, usage=usage_info([final])
        )

    def _constraint(
        self, req: ChatCompletionRequest, mode: ToolMode
    ) -> StructuredOutputsParams | None:
        constraint = structured_from_request(req)
        if mode.constrained:
            if constraint is not None:
                raise constraint_error(
                    f"tool_choice {mode.kind} cannot be combined with another output "
                    "constraint (response_format, structured_outputs).",
                    param="tool_choice",
                )
            return mode.structured_outputs()
        if mode.kind == "auto" and self.tool_parser_cls is None:
            raise constraint_error(
                'tool_choice "auto" needs the server started with --tool-call-parser; '
                'use "required", a named function or "none".',
                param="tool_choice",
            )
        return constraint

    def _parser(self, mode: ToolMode) -> ToolParser | None:
        """A fresh parser for one choice (None: the output is plain content)."""
        if mode.constrained:
            return ConstrainedToolParser(mode)
        if mode.kind == "auto" and self.tool_parser_cls is not None:
            return self.tool_parser_cls()
        return None

    @staticmethod
    def _finish_reason(reason: str | None, mode: ToolMode, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a named function ends in "stop".
        if reason == "stop" and called and mode.kind != "named":
            return "tool_calls"
        return reason

    def _choice(self, comp: CompletionOutput, top: int | None, mode: ToolMode) -> ChatChoice:
        message = ChatResponseMessage(content=comp.text)
        parser = self._parser(mode)
        called = False
        if parser is not None:
            extracted = parser.extract(comp.text)
            called = extracted.tools_called
            message = ChatResponseMessage(
                content=extracted.content,
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
        self,
        req: ChatCompletionRequest,
        header: ChunkHeader,
        stream: RequestStream,
        top: int | None,
        mode: ToolMode,
    ) -> AsyncIterator[str]:
        tracker = DeltaTracker()
        parsers = {index: self._parser(mode) for index in range(req.n)}
        texts = dict.fromkeys(range(req.n), "")
        called = dict.fromkeys(range(req.n), False)

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
        async for _, out in merge_streams([stream]):
            for d in tracker.update(out):
                logprobs = None
                if top is not None and d.logprobs is not None:
                    logprobs = self.logprobs(d.token_ids, d.logprobs, top)
                parser = parsers[d.index]
                if parser is None:
                    delta = DeltaMessage(content=d.text) if d.text else None
                else:
                    texts[d.index] += d.text
                    parsed = parser.stream(texts[d.index], d.finish_reason is not None)
                    called[d.index] |= bool(parsed.tool_calls)
                    delta = _delta_message(parsed) if parsed else None
                if delta is not None or (logprobs is not None and logprobs.content):
                    choice = ChatStreamChoice(
                        index=d.index, delta=delta or DeltaMessage(content=""), logprobs=logprobs
                    )
                    yield chunk([choice])
                if d.finish_reason is not None:
                    reason = self._finish_reason(d.finish_reason, mode, called[d.index])
                    end = ChatStreamChoice(
                        index=d.index, delta=DeltaMessage(), finish_reason=reason
                    )
                    yield chunk([end])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage_info([tracker.last]))


def _delta_message(parsed: StreamedDelta) -> DeltaMessage:
    calls = [
        DeltaToolCall(
            index=tc.index,
            id=tc.id,
            type="function" if tc.id is not None else None,
            function=DeltaFunctionCall(name=tc.name, arguments=tc.arguments),
        )
        for tc in parsed.tool_calls
    ]
    return DeltaMessage(content=parsed.content or None, tool_calls=calls or None)

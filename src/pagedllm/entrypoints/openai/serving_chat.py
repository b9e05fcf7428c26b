"""/v1/chat/completions: the conversation rendered by the chat template, n choices."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving import (
    ChunkHeader,
    DeltaTracker,
    OpenAIServing,
    ServingError,
    merge_streams,
    sse,
    top_entries,
    usage_info,
)


class OpenAIServingChat(OpenAIServing):
    async def create(
        self, req: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        """The response, or for ``stream: true`` the server-sent events to send."""
        self.check_model(req.model)
        if req.tools:
            raise ServingError("tools are not supported.", param="tools")
        top = self._top_logprobs(req)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = self.encode(text, add_special=False, param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
        params = self.sampling_params(req, len(ids), max_tokens, top, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt": text, "prompt_token_ids": ids}
        header = ChunkHeader(request_id, self.model.name)
        result = await self.respond(
            raw,
            request_id,
            [(prompt, params)],
            req.stream,
            lambda streams: self._stream(req, header, streams[0], top),
        )
        if isinstance(result, StreamingResponse):
            return result
        (final,) = result
        choices = [
            ChatChoice(
                index=comp.index,
                message=ChatResponseMessage(content=comp.text),
                logprobs=self.logprobs(comp.token_ids, comp.logprobs, top)
                if top is not None and comp.logprobs is not None
                else None,
                finish_reason=comp.finish_reason,
            )
            for comp in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id, model=self.model.name, choices=choices, usage=usage_info([final])
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
    ) -> AsyncIterator[str]:
        tracker = DeltaTracker()

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
                if d.text or (logprobs is not None and logprobs.content):
                    delta = DeltaMessage(content=d.text)
                    yield chunk([ChatStreamChoice(index=d.index, delta=delta, logprobs=logprobs)])
                if d.finish_reason is not None:
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=d.index,
                                delta=DeltaMessage(),
                                finish_reason=d.finish_reason,
                            )
                        ]
                    )
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage_info([tracker.last]))

"""/v1/completions: one engine request per prompt, n choices each, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.core.outputs import CompletionOutput, TokenLogprobs
from pagedllm.engine.async_engine import RequestStream
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE,
    DeltaTracker,
    OpenAIServing,
    ServingError,
    collect_finals,
    error_event,
    event_stream,
    merge_streams,
    sse,
    top_entries,
    unless_disconnected,
    usage_info,
)
from pagedllm.entrypoints.openai.structured import from_request as structured_from_request
from pagedllm.entrypoints.openai.structured import precompile
from pagedllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def create(
        self, req: CompletionRequest, raw: Request
    ) -> CompletionResponse | StreamingResponse:
        """The response, or for ``stream: true`` the server-sent events to send."""
        self.check_model(req.model)
        if req.suffix:
            raise ServingError("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ServingError("best_of is not supported (only best_of == n).", param="best_of")
        if req.echo and req.logprobs is not None:
            raise ServingError("echo together with logprobs is not supported.", param="echo")
        constraint = structured_from_request(req)
        await precompile(self.engine, constraint)
        prompts = self._prompts(req.prompt)
        requests: list[tuple[PromptType, SamplingParams]] = []
        for prompt in prompts:
            n_tokens = len(prompt["prompt_token_ids"])
            requests.append(
                (
                    prompt,
                    self.sampling_params(
                        req, n_tokens, req.max_tokens, req.logprobs, structured_outputs=constraint
                    ),
                )
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_requests(request_id, requests)
        echoes = [self._echo_text(p) if req.echo else "" for p in prompts]
        if req.stream:
            return event_stream(self._stream(req, request_id, streams, echoes), streams)
        finals = await unless_disconnected(collect_finals(streams), raw)
        choices = []
        for i, out in enumerate(finals):
            for comp in out.outputs:
                choices.append(self._choice(req, i * req.n + comp.index, comp, echoes[i]))
        return CompletionResponse(
            id=request_id, model=self.model.name, choices=choices, usage=usage_info(finals)
        )

    def _prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[dict]:
        """Each prompt as {"prompt", "prompt_token_ids"}: a string, token ids, or lists of them."""
        if isinstance(prompt, str):
            items: Sequence[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = prompt  # type: ignore[assignment]
        if not items:
            raise ServingError("prompt must not be empty.", param="prompt")
        result = []
        for item in items:
            if isinstance(item, str):
                result.append({"prompt": item, "prompt_token_ids": self.encode(item)})
            else:
                result.append({"prompt": None, "prompt_token_ids": list(item)})
            if not result[-1]["prompt_token_ids"]:
                raise ServingError("prompt must not be empty.", param="prompt")
        return result

    def _echo_text(self, prompt: dict) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return self.tokenizer.decode(prompt["prompt_token_ids"])

    def _choice(
        self, req: CompletionRequest, index: int, comp: CompletionOutput, echo: str
    ) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None and comp.logprobs is not None:
            logprobs = self.logprobs(comp.token_ids, comp.logprobs, 0)
        return CompletionChoice(
            index=index, text=echo + comp.text, logprobs=logprobs, finish_reason=comp.finish_reason
        )

    def logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs], text_offset: int
    ) -> CompletionLogprobs:
        """OpenAI's completions logprobs: per token its text, logprob, top-k and text offset."""
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry[token_id].logprob)
            top: dict[str, float] = {}
            for t, lp in top_entries(entry):
                top.setdefault(self.token_text(t), lp)  # texts may repeat: keep the likeliest
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        streams: list[RequestStream],
        echoes: list[str],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        trackers = [DeltaTracker(index_offset=i * req.n) for i in range(len(streams))]
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=self.model.name,
                    choices=choices,
                    usage=usage,
                )
            )

        try:
            for i, echo in enumerate(echoes):
                if echo:
                    yield chunk(
                        [CompletionChoice(index=i * req.n + k, text=echo) for k in range(req.n)]
                    )
            async for i, out in merge_streams(streams):
                for d in trackers[i].update(out):
                    logprobs = None
                    if d.logprobs is not None:
                        logprobs = self.logprobs(d.token_ids, d.logprobs, offsets.get(d.index, 0))
                        offsets[d.index] = offsets.get(d.index, 0) + sum(
                            len(t) for t in logprobs.tokens
                        )
                    choice = CompletionChoice(
                        index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason
                    )
                    yield chunk([choice])
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], usage_info([t.last for t in trackers]))
        except Exception as e:
            yield error_event(e)
        yield SSE_DONE

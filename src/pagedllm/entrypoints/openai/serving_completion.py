"""/v1/completions: one engine request per prompt, n choices each, streamed or not.

``echo`` with ``logprobs`` scores the prompt as OpenAI's legacy completions and vLLM do (what
lm-evaluation-harness's loglikelihood tasks send): the choice's logprobs start with the
prompt's tokens, from the engine's ``prompt_logprobs`` (the first is null: nothing precedes
it), then the generated ones; ``max_tokens: 0`` returns the prompt alone.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.core.outputs import CompletionOutput, RequestOutput, TokenLogprobs
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
    ChunkHeader,
    DeltaTracker,
    OpenAIServing,
    ServingError,
    merge_streams,
    sse,
    streamed_usage,
    top_entries,
    usage_info,
)
from pagedllm.entrypoints.openai.structured import from_request as structured_from_request
from pagedllm.entrypoints.openai.structured import precompile
from pagedllm.sampling_params import SamplingParams


@dataclasses.dataclass
class Echo:
    """What a choice repeats of its prompt before the generated text."""

    text: str  # "" without echo
    token_ids: list[int]  # the prompt's ids, for their logprobs
    logprobs: bool  # whether the prompt's logprobs lead the choice's logprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create(
        self, req: CompletionRequest, raw: Request
    ) -> CompletionResponse | StreamingResponse:
        """The response, or for ``stream: true`` the server-sent events to send."""
        self.check_model(req.model)
        constraint = structured_from_request(req)
        await precompile(self.engine, constraint)
        prompts = self._prompts(req.prompt)
        scored = req.echo and req.logprobs is not None
        # max_tokens 0 still runs one step (the prompt's logprobs come from it); its token
        # is dropped below.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        requests: list[tuple[PromptType, SamplingParams]] = []
        for prompt in prompts:
            n_tokens = len(prompt["prompt_token_ids"])
            params = self.sampling_params(
                req,
                n_tokens,
                max_tokens,
                req.logprobs,
                prompt_logprobs=req.logprobs if scored else None,
                structured_outputs=constraint,
            )
            requests.append((prompt, params))
        echoes = [
            Echo(self._echo_text(p) if req.echo else "", p["prompt_token_ids"], scored)
            for p in prompts
        ]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        header = ChunkHeader(request_id, self.response_model(req.model))
        result = await self.respond(
            raw,
            request_id,
            requests,
            req.stream,
            lambda s: self._stream(req, header, s, echoes),
            req.model,
        )
        if isinstance(result, StreamingResponse):
            return result
        finals = [self._visible(req, out) for out in result]
        choices = []
        for i, out in enumerate(finals):
            for comp in out.outputs:
                index = i * req.n + comp.index
                choices.append(self._choice(req, index, comp, echoes[i], out.prompt_logprobs))
        return CompletionResponse(
            id=request_id, model=header.model, choices=choices, usage=usage_info(finals)
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
                self.check_token_ids(item, "prompt")
                result.append({"prompt": None, "prompt_token_ids": list(item)})
            if not result[-1]["prompt_token_ids"]:
                raise ServingError("prompt must not be empty.", param="prompt")
        return result

    def _echo_text(self, prompt: dict) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return self.tokenizer.decode(prompt["prompt_token_ids"])

    @staticmethod
    def _visible(req: CompletionRequest, out: RequestOutput) -> RequestOutput:
        """The output a client sees: with max_tokens 0, without the one token generated."""
        if req.max_tokens != 0:
            return out
        empty = [
            dataclasses.replace(
                c,
                text="",
                token_ids=[],
                logprobs=None if c.logprobs is None else [],
                cumulative_logprob=None,
                finish_reason="length" if c.finish_reason is not None else None,
            )
            for c in out.outputs
        ]
        return dataclasses.replace(out, outputs=empty)

    def _choice(
        self,
        req: CompletionRequest,
        index: int,
        comp: CompletionOutput,
        echo: Echo,
        prompt_logprobs: list[TokenLogprobs | None] | None,
    ) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None and comp.logprobs is not None:
            logprobs = self._prompt_logprobs(echo, prompt_logprobs)
            self.add_logprobs(logprobs, comp.token_ids, comp.logprobs)
        return CompletionChoice(
            index=index,
            text=echo.text + comp.text,
            logprobs=logprobs,
            finish_reason=comp.finish_reason,
        )

    def _prompt_logprobs(
        self, echo: Echo, prompt_logprobs: list[TokenLogprobs | None] | None
    ) -> CompletionLogprobs:
        """The prompt's part of an echoed choice's logprobs (empty unless echo + logprobs)."""
        result = CompletionLogprobs()
        if not echo.logprobs or prompt_logprobs is None:
            return result
        self.add_logprobs(result, echo.token_ids, prompt_logprobs)
        return result

    def add_logprobs(
        self,
        result: CompletionLogprobs,
        token_ids: list[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> None:
        """Append OpenAI's completions logprobs of these tokens: text, logprob, top-k and
        text offset (continuing from the last token already in result)."""
        offset = result.text_offset[-1] + len(result.tokens[-1]) if result.tokens else 0
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:  # the first prompt token: nothing to condition on
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(entry[token_id].logprob)
            top: dict[str, float] = {}
            for t, lp in top_entries(entry):
                top.setdefault(self.token_text(t), lp)  # texts may repeat: keep the likeliest
            result.top_logprobs.append(top)

    async def _stream(
        self,
        req: CompletionRequest,
        header: ChunkHeader,
        streams: list[RequestStream],
        echoes: list[Echo],
    ) -> AsyncIterator[str]:
        trackers = [DeltaTracker(index_offset=i * req.n) for i in range(len(streams))]
        sent: dict[int, CompletionLogprobs] = {}  # choice index -> its logprobs so far

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                CompletionResponse(
                    id=header.id,
                    created=header.created,
                    model=header.model,
                    choices=choices,
                    usage=usage,
                )
            )

        async for i, out in merge_streams(streams):
            out = self._visible(req, out)
            for d in trackers[i].update(out):
                # A choice's first chunk carries the echoed prompt and the prompt's logprobs.
                first = d.index not in sent
                if first:
                    sent[d.index] = self._prompt_logprobs(echoes[i], trackers[i].prompt_logprobs)
                so_far = sent[d.index]
                start = 0 if first else len(so_far.tokens)
                logprobs = None
                if d.logprobs is not None:
                    self.add_logprobs(so_far, d.token_ids, d.logprobs)
                    logprobs = CompletionLogprobs(
                        tokens=so_far.tokens[start:],
                        token_logprobs=so_far.token_logprobs[start:],
                        top_logprobs=so_far.top_logprobs[start:],
                        text_offset=so_far.text_offset[start:],
                    )
                text = echoes[i].text + d.text if first else d.text
                choice = CompletionChoice(
                    index=d.index, text=text, logprobs=logprobs, finish_reason=d.finish_reason
                )
                yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], streamed_usage(trackers))

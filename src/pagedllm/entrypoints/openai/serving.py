"""What completions and chat completions share: model check, prompts, sampling parameters,
errors, logprob formatting, streaming deltas and client-disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedllm.core.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from pagedllm.engine.llm_engine import PromptType
from pagedllm.engine.tokenizer import encode_text
from pagedllm.entrypoints.openai.protocol import (
    RESERVED_KWARGS,
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UsageInfo,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

T = TypeVar("T")


class ServingError(Exception):
    """An error answered as an OpenAI-style error body with an HTTP status."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        # Messages may quote the request (a model name); a lone surrogate in it would make the
        # error body impossible to encode as UTF-8, so it is written as an escape.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )


class ClientDisconnected(Exception):
    """The client went away; its request has been aborted."""


@dataclass(frozen=True)
class ServedModel:
    names: list[str]  # names clients may use; the first is the default and in metrics
    path: str  # the model folder
    max_model_len: int
    chat_template: str | None = None  # --chat-template (None: the tokenizer's own)
    # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): LoRARequests
    loras: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.names[0]

    def lora_for(self, name: str | None) -> Any:
        """The LoRARequest a request for model ``name`` runs with (None: the base model)."""
        return None if name is None else self.loras.get(name)

    def serves(self, name: str) -> bool:
        """A served name, an adapter's name, or a path of the model folder (clients that load
        its tokenizer may send the folder as they know it: relative, absolute, with a
        trailing slash)."""
        if name in self.names or name in self.loras:
            return True
        try:
            return os.path.isdir(name) and os.path.samefile(name, self.path)
        except (OSError, ValueError):  # a name no file system path can have
            return False


class OpenAIServing:
    """Base of the completion and chat handlers: one engine, one served model."""

    def __init__(self, engine: AsyncLLMEngine, model: ServedModel) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = engine.get_tokenizer()
        self.vocab_size: int = engine.engine.config.model.hf_config.vocab_size
        self._token_texts: dict[int, str] = {}

    def response_model(self, requested: str | None) -> str:
        """The ``model`` of a response: the name the request used (as OpenAI and vLLM
        answer), else the served model's first name."""
        return requested if requested is not None else self.model.name

    # ---- request checks ------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """A 404 (OpenAI's answer) unless name is None or a name of the served model."""
        if name is not None and not self.model.serves(name):
            raise model_not_found(name, self.model)

    def encode(self, text: str, add_special: bool = True, param: str = "prompt") -> list[int]:
        try:
            return encode_text(self.tokenizer, text, add_special)
        except ValueError as e:  # text that is not valid Unicode
            raise ServingError(str(e), param=param) from e

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation, by the tokenizer's chat template."""
        template = self.model.chat_template
        if not template and not getattr(self.tokenizer, "chat_template", None):
            raise ServingError(
                "the model's tokenizer has no chat template.",
                param="messages",
                code="chat_template_error",
            )
        reserved = sorted(set(template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            # A template is code run on the event loop: a request may not bring its own, nor
            # replace the arguments the server passes.
            raise ServingError(
                f"chat_template_kwargs may not set {', '.join(reserved)}.",
                param="chat_template_kwargs",
            )
        conversation = [template_message(m) for m in messages]
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools  # templates of tool-tuned models list them in the prompt
        if template:
            extra["chat_template"] = template
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except Exception as e:  # a template error is the request's fault (roles, fields)
            raise ServingError(
                f"cannot apply the chat template: {e}",
                param="messages",
                code="chat_template_error",
            ) from e

    def sampling_params(
        self,
        req: SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str = "prompt",
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams of a request, after the context-length check; errors are 400s."""
        if req.logit_bias:
            raise ServingError("logit_bias is not supported.", param="logit_bias")
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        limit = self.model.max_model_len
        wanted = prompt_len + (max_tokens or 1)
        if wanted > limit:
            raise ServingError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {wanted} tokens ({prompt_len} in the prompt, {max_tokens or 1} for "
                "the completion). Please reduce the length of the prompt or of the completion.",
                param=prompt_param if prompt_len >= limit else "max_tokens",
                code="context_length_exceeded",
            )
        # Generation ends at max_tokens whatever min_tokens says (a larger one is moot).
        max_tokens = limit - prompt_len if max_tokens is None else max_tokens
        min_tokens = min(req.min_tokens, max_tokens)
        try:
            return SamplingParams(
                n=req.n,
                temperature=self.default("temperature", req.temperature, 1.0),
                top_p=self.default("top_p", req.top_p, 1.0),
                top_k=self.default("top_k", req.top_k, 0),
                min_p=self.default("min_p", req.min_p, 0.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=self.default("repetition_penalty", req.repetition_penalty, 1.0),
                seed=None if req.seed is None else int64_seed(req.seed, req.n),
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured_outputs,
            )
        except ValueError as e:
            raise bad_request(e, req) from e

    def default(self, name: str, value: float | None, fallback: float) -> float:
        """A request's value; unset, the model's generation_config.json default (as vLLM)."""
        if value is not None:
            return value
        return self.engine.sampling_defaults.get(name, fallback)

    # ---- running requests ----------------------------------------------------------------
    async def respond(
        self,
        raw: Request,
        request_id: str,
        prompts: Sequence[tuple[PromptType, SamplingParams]],
        stream: bool,
        events: Callable[[list[RequestStream]], AsyncIterator[str]],
        model_name: str | None = None,
    ) -> list[RequestOutput] | StreamingResponse:
        """Queue one engine request per prompt; then either the server-sent events that
        ``events(streams)`` writes (ended by an error event if needed and ``[DONE]``), or
        the final output of each request, aborted if the client goes away first."""
        for _, params in prompts:
            choose_output_kind(params, stream)
        streams = await self.add_requests(request_id, prompts, model_name)
        if stream:
            return event_stream(sse_body(events(streams)), streams)
        return await unless_disconnected(collect_finals(streams), raw)

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[tuple[PromptType, SamplingParams]],
        model_name: str | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt, with the adapter model_name names (if it
        names one); on any error the ones queued are aborted."""
        lora = self.model.lora_for(model_name)
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(rid, prompt, params, lora_request=lora)
                )
        except BaseException as e:
            for stream in streams:
                stream.abort()
            error = engine_error(e)
            if error is e:
                raise
            raise error from e
        return streams

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """/tokenize: a prompt, or messages rendered by the chat template."""
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            text = self.render_chat(req.messages, req.add_generation_prompt)
            ids = self.encode(text, req.add_special_tokens, param="messages")
        else:
            ids = self.encode(req.prompt, add_special=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def tokenizer_info(self) -> TokenizerInfo:
        tok = self.tokenizer
        chat_template = self.model.chat_template or getattr(tok, "chat_template", None)
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            tokenizer_path=os.path.abspath(self.engine.engine.config.model.tokenizer),
            eos_token=getattr(tok, "eos_token", None),
            bos_token=getattr(tok, "bos_token", None),
            pad_token=getattr(tok, "pad_token", None),
            chat_template=chat_template if isinstance(chat_template, str) else None,
            model_max_length=self.model.max_model_len,
        )

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """A 400 naming param unless every id is in the model's vocabulary (the schema's
        maximum for token ids)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ServingError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).",
                param=param,
            )

    def token_text(self, token_id: int) -> str:
        """The text of one token as the API shows it (cached: the vocabulary is fixed)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


# Arguments of apply_chat_template the server sets itself (a request may not replace them).
RESERVED_TEMPLATE_KWARGS = RESERVED_KWARGS


def int64_seed(seed: int, n: int) -> int:
    """Any integer as a seed the engine takes: seed .. seed + n - 1 are 64-bit integers.
    (Exact bounds near 2**63 cannot be stated in a JSON schema: validators compare numbers
    as doubles, so the API takes any integer and reduces it.)"""
    low, size = -(2**63), 2**64 - (n - 1)
    return (seed - low) % size + low


def model_not_found(name: str, model: ServedModel) -> ServingError:
    return ServingError(
        f"The model `{name}` does not exist; this server serves "
        f"{', '.join(repr(n) for n in model.names)}.",
        status=404,
        param="model",
        code="model_not_found",
    )


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ServingError(
                f"only text content parts are supported, got {part.type!r}.", param="messages"
            )
        parts.append(part.text)
    return "\n".join(parts)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it; a tool call's arguments as an object (templates
    write them with tojson, which would quote a JSON string again)."""
    out: dict[str, Any] = {"role": message.role, "content": message_text(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError as e:
                    raise ServingError(
                        f"a tool call's arguments are not JSON: {e}", param="messages"
                    ) from e
            call["function"] = fn
            calls.append(call)
        out["tool_calls"] = calls
    return out


def constraint_error(message: str, param: str | None = None) -> ServingError:
    """A 400 for an output constraint or a tool list that no schema can rule out: what the
    grammar engine or the tool rules refuse (code ``invalid_output_constraint``)."""
    return ServingError(message, param=param, code="invalid_output_constraint")


def add_warning(raw: Request, text: str) -> None:
    """A warning for the response's ``Warning`` header (see ``warning_header``)."""
    if not hasattr(raw.state, "warnings"):
        raw.state.warnings = []
    raw.state.warnings.append(text)


def warning_header(raw: Request) -> str | None:
    """RFC 9111's ``Warning: 299 pagedllm "..."`` for what the request did not get."""
    texts = getattr(raw.state, "warnings", None)
    if not texts:
        return None
    return ", ".join('299 pagedllm "{}"'.format(t.replace('"', "'")) for t in texts)


def bad_request(error: ValueError, req: BaseModel | None = None) -> ServingError:
    """A 400 from a ValueError whose message starts with the offending field's name."""
    word = str(error).split(" ", 1)[0]
    param = word if req is not None and word in type(req).model_fields else None
    return ServingError(str(error), param=param)


def engine_error(error: BaseException) -> BaseException:
    """The ServingError for an engine exception (other exceptions pass through)."""
    if isinstance(error, ValueError):
        return bad_request(error)
    if isinstance(error, EngineOverloadedError):
        return ServingError(str(error), status=503, code="server_overloaded")
    if isinstance(error, EngineDeadError):
        return ServingError(str(error), status=503, code="engine_dead")
    return error


# ---- outputs -----------------------------------------------------------------------------
def choose_output_kind(params: SamplingParams, stream: bool) -> None:
    """What the engine builds for a request: a stream reads each step's new tokens (DELTA),
    a response only the last output (FINAL_ONLY); neither copies what it has already."""
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


@dataclass
class ChoiceDelta:
    """What one choice gained since the previous delta."""

    index: int  # the choice's index in the response (prompt offset applied)
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # for token_ids, when logprobs were asked for
    finish_reason: str | None


@dataclass
class DeltaTracker:
    """Turns the DELTA RequestOutputs of one prompt into per-choice deltas, and counts the
    tokens for the usage.

    A delta is produced when a choice has new text or has finished; tokens without visible
    text yet (a partial UTF-8 character, a held-back stop string) ride with the next one.
    """

    index_offset: int = 0
    held: dict[int, CompletionOutput] = field(default_factory=dict)  # tokens awaiting text
    done: set[int] = field(default_factory=set)
    prompt_tokens: int = 0
    completion_tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens so far
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the first output carries them

    def update(self, out: RequestOutput) -> list[ChoiceDelta]:
        self.prompt_tokens = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        deltas = []
        for comp in out.outputs:
            if comp.index in self.done:
                continue
            count = self.completion_tokens.get(comp.index, 0) + len(comp.token_ids)
            self.completion_tokens[comp.index] = count
            held = self.held.pop(comp.index, None)
            if held is not None:
                held.add(comp)
                comp = held
            if not comp.text and comp.finish_reason is None:
                self.held[comp.index] = comp
                continue
            index = self.index_offset + comp.index
            deltas.append(
                ChoiceDelta(index, comp.text, comp.token_ids, comp.logprobs, comp.finish_reason)
            )
            if comp.finish_reason is not None:
                self.done.add(comp.index)
        return deltas


def usage_info(outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    """Token counts over the requests of one API call (all n choices of each)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def streamed_usage(trackers: Sequence[DeltaTracker]) -> UsageInfo:
    """usage_info of a streamed API call, from what its trackers counted."""
    prompt = sum(t.prompt_tokens for t in trackers)
    completion = sum(sum(t.completion_tokens.values()) for t in trackers)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def error_event(error: Exception) -> str:
    """An error met after a stream began, sent as an event (the status is already 200)."""
    err = engine_error(error)
    if not isinstance(err, ServingError):
        err = ServingError(str(error), status=500)
    return sse(err.to_response())


def top_entries(entry: TokenLogprobs, limit: int | None = None) -> list[tuple[int, float]]:
    """(token id, logprob) of one position, most likely first, at most limit of them."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    if limit is not None:
        ranked = ranked[:limit]
    return [(tid, lp.logprob) for tid, lp in ranked]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event as OpenAI writes it: ``data: {json}`` and a blank line."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_body(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then an error event if they failed, then ``[DONE]`` (as OpenAI ends)."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        yield error_event(e)
    yield SSE_DONE


@dataclass(frozen=True)
class ChunkHeader:
    """The fields every chunk of one streamed response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def event_stream(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> StreamingResponse:
    """The HTTP response of a streamed request.

    Starlette cancels the events when the client disconnects, which aborts the requests; the
    background abort also covers a disconnect before the first event was pulled.
    """

    def abort_unfinished() -> None:
        for stream in streams:
            stream.abort()

    return StreamingResponse(
        events, media_type="text/event-stream", background=BackgroundTask(abort_unfinished)
    )


# ---- merging and disconnects -------------------------------------------------------------
async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position.

    Leaving early (or an error in one stream) aborts every stream that has not finished.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0].outputs()) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream.outputs():
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def collect_finals(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The final output of each request, in the streams' order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    return [f for f in finals if f is not None]


async def until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await work, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()

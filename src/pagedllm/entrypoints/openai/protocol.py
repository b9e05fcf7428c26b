"""Request and response bodies of the OpenAI-compatible API (pydantic), as OpenAI sends them.

Beyond OpenAI's fields the requests accept vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, ...). Unknown fields are ignored, as OpenAI and vLLM do.
Requests are strict where OpenAI's types are (no "yes" for a boolean, no true for a token id)
and state their ranges here, so that /openapi.json says what the server accepts. The few
rules that tie two fields together are listed in CROSS_FIELD_RULES and answered with a 400
whose ``code`` names the rule.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_serializer,
)

from pagedllm.sampling_params import MAX_LOGPROBS

# Error codes of the 400s no single field's schema can rule out (documented in /openapi.json).
CROSS_FIELD_RULES = {
    "context_length_exceeded": "the prompt plus max_tokens exceed the model's context length",
    "chat_template_error": "the model's chat template refused the conversation",
    "invalid_output_constraint": "an output constraint or tool list that does not compile "
    "(a JSON schema, regex or grammar the grammar engine rejects, a tool_choice naming no "
    "given tool, two constraints at once)",
    "invalid_function_arguments": "a function_call item (or a tool call) whose arguments "
    "are not JSON text",
    "dimensions_not_supported": "embedding dimensions the model was not trained to be cut "
    "to (its config's matryoshka_dimensions)",
}
# Arguments of apply_chat_template the server sets itself (chat_template_kwargs may not).
RESERVED_KWARGS = frozenset(
    {"chat_template", "tokenize", "conversation", "messages", "add_generation_prompt"}
)
# Marks a token-id field; the served app fills in the model's vocabulary size as its maximum.
TOKEN_ID_MARK = "x-token-id"
MAX_N = 128  # most choices per prompt (OpenAI's limit); the engine enforces the same


def _integral(value: object) -> object:
    """JSON Schema's integer: 8.0 is one (as JSON Schema counts), true and "8" are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def Int(**constraints: Any) -> Any:  # noqa: N802 - used as a type
    """An integer field type with its range (ge=, le=) in the schema; 8.0 is accepted."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


TokenId = Int(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequest(BaseModel):
    """A request body: strict types (OpenAI's), unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ---- errors ------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str  # "invalid_request_error" | "server_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared request fields ---------------------------------------------------------------
class StreamOptions(OpenAIRequest):
    include_usage: bool = False  # end the stream with a chunk that carries usage


class SamplingFields(OpenAIRequest):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    n: Int(ge=1, le=MAX_N) = 1
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: Int() | None = Field(None, description="any integer (taken modulo 2**64)")
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    logit_bias: dict[str, float] | None = Field(
        None, max_length=0, description="not supported: only an empty object"
    )
    # vLLM's extras
    top_k: Int(ge=-1) | None = Field(None, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: Int(ge=0) = Field(0, description="at most max_tokens take effect")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output constraints: OpenAI's response_format, vLLM's structured_outputs and the older
    # guided_* fields (structured.py turns them into StructuredOutputsParams).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyStr
        | PromptIds
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | (Annotated[list[PromptIds], Field(min_length=1)])
    )
    max_tokens: Int(ge=0) | None = Field(16, description="0 with echo: score the prompt only")
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # top logprobs per token
    echo: bool = False
    best_of: None = Field(None, description="not supported (always n)")
    suffix: None = Field(None, description="not supported")


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(OpenAIRequest):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int(ge=1) | None = None
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="with logprobs: true (ignored without)"
    )
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (the grammar allows no second)"
    )
    thinking_token_budget: Int(ge=0) | None = Field(
        None,
        description="with --reasoning-parser: the most tokens of reasoning; then the grammar "
        "closes the reasoning block",
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extra variables of the chat template (chat_template, tokenize, "
        "conversation, messages and add_generation_prompt are not allowed)",
        json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_KWARGS)}}},
    )


# ---- responses ---------------------------------------------------------------------------
class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None  # on the call's first delta only
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> text
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only the fields a delta carries: {"content": "..."}, and {} at the end.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- models, tokenizer -------------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(OpenAIRequest):
    """/tokenize of a prompt, as completions encode it."""

    model: str | None = None
    prompt: str
    messages: None = None  # one of prompt and messages
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIRequest):
    """/tokenize of messages, rendered by the chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    prompt: None = None  # one of prompt and messages
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class TokenizerInfo(OpenAIModel):
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does
    (lm-evaluation-harness's remote tokenizer reads it)."""

    tokenizer_class: str
    tokenizer_path: str  # the folder holding tokenizer.json, for clients on this machine
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


# ---- the Responses API (/v1/responses) ---------------------------------------------------
class InputTextPart(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessageItem(OpenAIRequest):
    """A message of the conversation (``type`` may be left out, as OpenAI allows)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(OpenAIRequest):
    """A call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text


class FunctionCallOutputItem(OpenAIRequest):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str


class ReasoningInputItem(OpenAIRequest):
    """An earlier reasoning item sent back (agents do): not part of the next prompt."""

    type: Literal["reasoning"]


InputItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


def _not_only_reasoning(items: list[Any]) -> list[Any]:
    if all(isinstance(item, ReasoningInputItem) for item in items):
        raise ValueError("input needs a message or a function call, not only reasoning items")
    return items


# At least one item that is not a reasoning item (the schema says so too).
InputItems = Annotated[
    list[InputItem],
    Field(
        min_length=1,
        json_schema_extra={
            "contains": {
                "not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}
            }
        },
    ),
    AfterValidator(_not_only_reasoning),
]


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema here


class NamedFunctionChoice(OpenAIRequest):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(OpenAIRequest):
    """``text.format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: NonEmptyStr | InputItems
    instructions: str | None = None  # a system message for this response only
    previous_response_id: str | None = None  # continue a stored response's conversation
    store: bool = True  # keep this response for previous_response_id
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted; the reasoning parser decides
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extra variables of the chat template, as on chat completions "
        "(enable_thinking: false turns Qwen3's thinking off)",
        json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_KWARGS)}}},
    )


# ---- embeddings (/v1/embeddings) ---------------------------------------------------------
class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int(ge=1) | None = Field(
        None, description="keep the first dimensions (models trained for it: Matryoshka)"
    )
    user: str | None = None  # accepted for compatibility; not used
    normalize: bool = Field(True, description="scale each vector to unit length (vLLM's extra)")


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

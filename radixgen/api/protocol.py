"""OpenAI-shaped request and response models (pydantic lives only in ``api``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixgen.constraints.report import ConstraintReport


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Request(BaseModel):
    # Unknown fields are refused by name (HTTP 400), as OpenAI does: silently ignoring a field
    # that changes the output would return something other than what was asked for.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    include_usage: bool = False
    include_partial: bool = False
    """radixgen's extension: with a JSON answer (``response_format`` json_schema or json_object),
    each chunk whose text completes a value carries ``delta.partial``, the answer so far as an
    object of its complete values (it only grows; the last equals the parsed answer)."""


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: _id("call"))
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    """vLLM's and SGLang's field: EOS and stop token ids are masked until this many tokens."""
    speculative: bool | None = None
    """Override the server's n-gram speculation for this request (greedy requests only)."""
    # Accepted and ignored: they do not change a text model's output (OpenAI's own fields for
    # storage, tracking, billing tiers, and options of models this server does not run).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    """false: at most one call per answer. true or absent: OpenAI lets the model call several;
    this server's answers carry one call (a valid answer under either)."""
    functions: list[FunctionDef] | None = None
    """The legacy form of tools (answered with message.function_call)."""
    function_call: str | dict[str, Any] | None = None
    # accepted and ignored (see SamplingFields): options of audio and reasoning models, and a
    # predicted output (it only speeds up OpenAI's own decoding; the answer is the same)
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    regex: str | None = None
    choices: list[str] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    regex: str | None = None
    choices: list[str] | None = None
    response_format: ResponseFormat | None = None


class ResponsesRequest(_Request):
    """OpenAI's Responses API request (POST /v1/responses); items stay plain dicts, checked where
    they are read (routes_responses.input_messages)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    stream: bool = False
    store: bool = True
    # accepted and ignored: they do not change a text model's output
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: Literal[False] | None = None


class GenerateRequest(_Request):
    """radixgen's native endpoint (used by the DSL's Endpoint backend)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    request_id: str | None = None


class TokenizeRequest(_Request):
    """radixgen's native /tokenize: token ids of a text or of each text in a list."""

    text: str | list[str]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """A thinking model's reasoning section (vLLM's and SGLang's field), apart from the answer."""
    tool_calls: list[ToolCall] | None = None
    function_call: ToolCallFunction | None = None
    """The legacy answer to a request with ``functions``."""


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    shortened: bool | None = None
    """radixgen's extension: true when budget steering closed the constrained output early so it
    finished complete within max_tokens (finish_reason stays "stop"); absent otherwise."""
    constraint_warnings: list[str] | None = None
    """radixgen's extension: what the response format's grammar could not enforce (a lenient
    compile dropped it; validators checked the answer against it instead); null otherwise."""
    constraint: ConstraintReport | None = None
    """radixgen's extension: what the constraint did to this answer (on a constrained answer
    only; in a stream, on the chunk that carries the finish_reason)."""


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    partial: Any = None
    """radixgen's extension (``stream_options.include_partial``): the answer so far, its complete
    values only; on the chunks whose text completed a value."""


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    shortened: bool | None = None
    """radixgen's extension: true when budget steering closed the constrained output early so it
    finished complete within max_tokens (finish_reason stays "stop"); absent otherwise."""
    constraint_warnings: list[str] | None = None
    """radixgen's extension: what the response format's grammar could not enforce (a lenient
    compile dropped it; validators checked the answer against it instead); null otherwise."""
    constraint: ConstraintReport | None = None
    """radixgen's extension: what the constraint did to this answer (on a constrained answer
    only; in a stream, on the chunk that carries the finish_reason)."""


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    shortened: bool | None = None
    """radixgen's extension: true when budget steering closed the constrained output early so it
    finished complete within max_tokens (finish_reason stays "stop"); absent otherwise."""
    constraint_warnings: list[str] | None = None
    """radixgen's extension: what the response format's grammar could not enforce (a lenient
    compile dropped it; validators checked the answer against it instead); null otherwise."""
    constraint: ConstraintReport | None = None
    """radixgen's extension: what the constraint did to this answer (on a constrained answer
    only; in a stream, on the chunk that carries the finish_reason)."""


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixgen"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody

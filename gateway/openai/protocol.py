"""Pydantic models of the OpenAI HTTP API (completions, chat completions, models, errors).

Requests follow vLLM's protocol: fields the OpenAI spec defines are typed and range-checked;
unknown fields are accepted and ignored (``extra="allow"``; the route logs them), as vLLM does;
fields we parse but cannot honour (``suffix``, ``logit_bias``, audio...) are
rejected by the serving classes with a 400 naming them. Responses mirror OpenAI's objects so the
official ``openai`` client parses them.

Numbers are bounded by what the sampler's protobuf fields hold (``UInt31``, ``Int32``), and
floats must be finite: a value the model lets through must never fail later, in the conversion
to a sampler request, as a 500.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "ImageURL",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "UsageInfo",
    "random_id",
]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- shared


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk


class UsageInfo(Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rlfleet"
    root: str | None = None  # the model folder the samplers loaded
    max_model_len: int | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


Stop = str | list[str] | None
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4e38  # just under float32's largest, so it stays finite in the proto
UInt31 = Annotated[int, Field(ge=0, le=INT32_MAX)]  # counts: uint32 in the proto, int in vLLM
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]  # token ids


class SamplingFields(OpenAIModel):
    """What completions and chat share (OpenAI's fields, then vLLM's extras)."""

    model: str
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Stop = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=FLOAT32_MAX)
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    max_tokens: UInt31 | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=INT32_MAX)
    suffix: str | None = None


class CompletionLogprobs(Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token that ended it


class CompletionResponse(Response):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# --------------------------------------------------------------------------- chat


class ImageURL(OpenAIModel):
    url: str = Field(min_length=1)  # a data URL, or http(s) from a host the settings allow
    detail: Literal["auto", "low", "high"] | None = None  # accepted and ignored, as vLLM does


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(OpenAIModel):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ResponseFormat(OpenAIModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: UInt31 | None = None  # deprecated by OpenAI, still sent
    max_completion_tokens: UInt31 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"index", "id", "type", "function"} pieces


class ChatChunkChoice(Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None

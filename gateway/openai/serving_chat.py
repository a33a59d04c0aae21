"""``POST /v1/chat/completions``: the messages go to the sampler as a ChatPrompt, so the chat
template is applied once, by the sampler, with the model's own tokenizer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from google.protobuf import struct_pb2

from gateway.backends import BackendLost, OpenedStream
from gateway.errors import ApiError, BadRequest
from gateway.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from gateway.openai.serving_engine import (
    FINISH,
    OpenAIServing,
    RequestContext,
    SSEResponse,
    TokenChunk,
    delta_logprobs,
    merge,
    sse,
    token_count,
)
from rlfleet.sampler.v1 import sampler_pb2

__all__ = ["OpenAIServingChat"]

_ROLES = {"developer": "system"}  # OpenAI's newer name; chat templates know "system"


def chat_logprobs(items: list[tuple[str, float, list[tuple[str, float]]]]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=token,
                logprob=logprob,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in top
                ],
            )
            for token, logprob, top in items
        ]
    )


class OpenAIServingChat(OpenAIServing):
    prompt_param = "messages"
    top_logprobs_param = "top_logprobs"

    def check(self, request: ChatCompletionRequest) -> None:
        self.check_common(request)
        if request.tools and request.tool_choice != "none":
            raise BadRequest("tools are not supported by this server", param="tools")
        if request.functions:
            raise BadRequest("functions are not supported by this server", param="functions")
        if request.response_format is not None and request.response_format.type != "text":
            raise BadRequest(
                f"response_format {request.response_format.type!r} is not supported",
                param="response_format",
            )
        if request.audio is not None or (request.modalities and request.modalities != ["text"]):
            raise BadRequest("only text output is supported", param="modalities")
        if request.chat_template is not None:
            raise BadRequest(
                "chat_template is not supported: the model's own template is applied",
                param="chat_template",
            )
        if not request.add_generation_prompt and not request.continue_final_message:
            raise BadRequest(
                "add_generation_prompt: false is only supported with continue_final_message",
                param="add_generation_prompt",
            )
        if request.top_logprobs and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def chat_prompt(self, request: ChatCompletionRequest) -> sampler_pb2.Prompt:
        messages = []
        chars = 0
        for i, message in enumerate(request.messages):
            if message.tool_calls:
                raise BadRequest("tool calls are not supported", param=f"messages[{i}].tool_calls")
            content = message.content
            if content is None:
                text = ""
            elif isinstance(content, str):
                text = content
            else:
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise BadRequest(
                            f"content parts of type {part.type!r} are not supported (text only)",
                            param=f"messages[{i}].content[{j}]",
                        )
                    parts.append(part.text)
                text = "\n".join(parts)
            chars += len(text)
            role = _ROLES.get(message.role, message.role)
            messages.append(sampler_pb2.ChatMessage(role=role, content=text))
        if chars > self.limits.max_prompt_chars:
            raise BadRequest(
                f"the messages have {chars} characters; at most {self.limits.max_prompt_chars} "
                "are accepted",
                param="messages",
                code="context_length_exceeded",
            )
        if request.continue_final_message and request.messages[-1].role != "assistant":
            raise BadRequest(
                "continue_final_message needs an assistant message last", param="messages"
            )
        chat = sampler_pb2.ChatPrompt(
            messages=messages, continue_final_message=request.continue_final_message
        )
        if request.chat_template_kwargs:
            kwargs = struct_pb2.Struct()
            try:
                kwargs.update(request.chat_template_kwargs)
            except (TypeError, ValueError) as exc:
                raise BadRequest(
                    f"chat_template_kwargs: {exc}", param="chat_template_kwargs"
                ) from None
            chat.chat_template_kwargs.CopyFrom(kwargs)
        return sampler_pb2.Prompt(chat=chat)

    async def create(self, request: ChatCompletionRequest, ctx: RequestContext) -> Response:
        model = self.check_model(request.model)
        self.check(request)
        prompt = self.chat_prompt(request)
        if request.max_completion_tokens is not None:
            max_tokens = self.max_tokens(request.max_completion_tokens, "max_completion_tokens")
        else:
            max_tokens = self.max_tokens(request.max_tokens, "max_tokens")
        top = request.top_logprobs or 0
        sampling = self.sampling(
            request, max_tokens=max_tokens, logprobs=request.logprobs, top_logprobs=top
        )
        stream_request = sampler_pb2.GenerateStreamRequest(prompt=prompt, sampling=sampling)
        echo = ""
        if request.echo and request.messages[-1].role == "assistant":
            echo = prompt.chat.messages[-1].content
        if request.stream:
            streams = await self.open_all([stream_request], max_tokens, ctx)
            return SSEResponse(self.stream(request, model, streams[0], echo, ctx), ctx)
        _, choices = await self.collect(stream_request, max_tokens, ctx)
        body = ChatCompletionResponse(
            model=model,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=echo + "".join(c.text)),
                    logprobs=chat_logprobs(c.logprobs) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=ctx.usage(),
        )
        return JSONResponse(body.model_dump(mode="json"))

    async def stream(
        self,
        request: ChatCompletionRequest,
        model: str,
        opened: OpenedStream,
        echo: str,
        ctx: RequestContext,
    ) -> AsyncIterator[str]:
        rid, created = random_id("chatcmpl"), int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)

        def chunk(choice: ChatChunkChoice) -> str:
            body = ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[choice],
                usage=ctx.usage() if continuous else None,
            ).model_dump(mode="json")
            for c in body["choices"]:
                c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            return sse(body)

        try:
            for i in range(request.n):  # the role first, as OpenAI does
                yield chunk(
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                )
                if echo:
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(content=echo)))
            async for _, delta in merge([opened]):
                ctx.add_completion(token_count(delta))
                lp = chat_logprobs(delta_logprobs(delta)) if request.logprobs else None
                if delta.text or (lp is not None and lp.content):
                    yield TokenChunk(
                        chunk(
                            ChatChunkChoice(
                                index=delta.index,
                                delta=DeltaMessage(content=delta.text),
                                logprobs=lp,
                            )
                        )
                    )
                if delta.finish_reason:
                    yield chunk(
                        ChatChunkChoice(
                            index=delta.index,
                            delta=DeltaMessage(),
                            finish_reason=FINISH.get(delta.finish_reason, "stop"),
                        )
                    )
            if include_usage:
                body = ChatCompletionChunk(
                    id=rid, created=created, model=model, choices=[], usage=ctx.usage()
                )
                yield sse(body)
        except (BackendLost, ApiError) as exc:
            yield self.stream_error(exc, ctx)
        yield sse("[DONE]")

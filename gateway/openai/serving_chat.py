"""``POST /v1/chat/completions``: the messages go to the sampler as a ChatPrompt, so the chat
template is applied once, by the sampler, with the model's own tokenizer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response
from google.protobuf import struct_pb2

from gateway.backends import BackendLost, OpenedStream
from gateway.errors import ApiError, BadRequest
from gateway.openai.images import check_count, image_refs, load_images
from gateway.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from gateway.openai.serving_engine import (
    FINISH,
    Choice,
    OpenAIServing,
    RequestContext,
    SSEResponse,
    TokenChunk,
    delta_logprobs,
    merge,
    sse,
    stream_request,
    token_count,
)
from gateway.openai.tools import (
    ToolPlan,
    call_id,
    plan_tools,
    proto_tool_calls,
    response_tool_calls,
    tools_structs,
)
from gateway.training.recording import SessionCall, reply_message
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


def message_content(
    message: ChatMessage, images: Iterator[bytes]
) -> tuple[str, list[sampler_pb2.ContentPart]]:
    """(content, parts) of a message as the sampler takes it: a message with images keeps its
    parts in order (the template puts each image where its part is), each image part taking
    the next of ``images``; any other gives its text parts joined as the content, as before
    images, so text-only models and engines see what they always saw."""
    content = message.content
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if all(part.type == "text" for part in content):
        return "\n".join(part.text or "" for part in content), []
    parts = []
    for part in content:
        if part.type == "text":
            parts.append(sampler_pb2.ContentPart(text=part.text or ""))
        else:
            image = sampler_pb2.Image(data=next(images))
            parts.append(sampler_pb2.ContentPart(image=image))
    return "", parts


class OpenAIServingChat(OpenAIServing):
    prompt_param = "messages"
    top_logprobs_param = "top_logprobs"

    def check(self, request: ChatCompletionRequest) -> ToolPlan:
        self.check_common(request)
        plan = plan_tools(request)
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
        return plan

    def chat_prompt(
        self, request: ChatCompletionRequest, plan: ToolPlan, images: Sequence[bytes] = ()
    ) -> sampler_pb2.Prompt:
        """The sampler's prompt; ``images`` are the bytes of the request's image parts, in
        order (load_images), each put where its part is."""
        if len(image_refs(request.messages)) != len(images):
            raise ValueError("chat_prompt needs the bytes of every image part (load_images)")
        messages = []
        chars = 0
        pending = iter(images)
        for i, message in enumerate(request.messages):
            text, parts = message_content(message, pending)
            chars += len(text) + sum(len(p.text) for p in parts)
            role = _ROLES.get(message.role, message.role)
            calls = proto_tool_calls(message.tool_calls or [], f"messages[{i}].tool_calls")
            chars += sum(len(c.arguments) for c in calls)
            if calls and role != "assistant":
                raise BadRequest(
                    "only assistant messages make tool calls", param=f"messages[{i}].tool_calls"
                )
            if role == "tool" and not message.tool_call_id:
                raise BadRequest(
                    "a tool message needs the tool_call_id it answers",
                    param=f"messages[{i}].tool_call_id",
                )
            messages.append(
                sampler_pb2.ChatMessage(
                    role=role,
                    content=text,
                    parts=parts,
                    tool_calls=calls,
                    tool_call_id=message.tool_call_id or "",
                    name=message.name or "",
                )
            )
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
            messages=messages,
            continue_final_message=request.continue_final_message,
            tools=tools_structs(plan.listed),
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

    async def create(
        self,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        session: SessionCall | None = None,
    ) -> Response:
        """Serve a chat completion; a training session's call (``session``) is recorded."""
        try:
            return await self._create(request, ctx, session)
        except ApiError as exc:
            if exc.param == "response_format" and request.response_format is None:
                exc.param = "tool_choice"  # the structured output a tool_choice asked for
            raise
        finally:
            if session is not None and not request.stream:
                session.release()  # recorded or failed: the session may call again

    async def _create(
        self, request: ChatCompletionRequest, ctx: RequestContext, session: SessionCall | None
    ) -> Response:
        model = self.check_model(request.model)
        plan = self.check(request)
        refs = image_refs(request.messages)
        if refs and session is not None:
            raise BadRequest(
                f"{refs[0].param}: a training session's calls cannot hold images yet (they "
                "would be recorded without their pixels)",
                param=refs[0].param,
            )
        info = self.pool.info()
        model_max = info.max_images_per_prompt if info is not None else 0
        check_count(refs, model_max=model_max, limit=self.limits.max_images)
        images = await load_images(refs, self.limits)
        prompt = self.chat_prompt(request, plan, images)
        if request.max_completion_tokens is not None:
            max_tokens = self.max_tokens(request.max_completion_tokens, "max_completion_tokens")
        else:
            max_tokens = self.max_tokens(request.max_tokens, "max_tokens")
        top = request.top_logprobs or 0
        sampling = self.sampling(
            request, max_tokens=max_tokens, logprobs=request.logprobs, top_logprobs=top
        )
        if plan.structured_output is not None:
            sampling.structured_output.CopyFrom(plan.structured_output)
        if session is not None:
            session.prepare(request.n, prompt, sampling)
        to_sampler = stream_request(prompt, sampling, streamed=request.stream)
        echo = ""
        if request.echo and request.messages[-1].role == "assistant":
            echo = prompt.chat.messages[-1].content
        if request.stream:
            try:
                streams = await self.open_all([to_sampler], max_tokens, ctx)
            except BaseException:
                if session is not None:
                    session.release()
                raise
            events = self.stream(request, plan, model, streams[0], echo, ctx, session)
            return SSEResponse(events, ctx)
        opened, choices = await self.collect(to_sampler, max_tokens, ctx)
        answers = [self._choice(c, plan, echo, request.logprobs) for c in choices]
        if session is not None:
            (choice,), (answer,) = choices, answers
            calls = [{"id": c["id"], **c["function"]} for c in answer.message.tool_calls or []]
            reply = reply_message(answer.message.content, calls)
            await session.finish(
                opened.start, choice.token_ids, choice.token_logprobs, choice.finish_code, reply
            )
        body = ChatCompletionResponse(model=model, choices=answers, usage=ctx.usage())
        return JSONResponse(body.model_dump(mode="json"))

    @staticmethod
    def _choice(c: Choice, plan: ToolPlan, echo: str, logprobs: bool) -> ChatChoice:
        """A finished completion as a choice: its text, or the calls it made."""
        text = echo + "".join(c.text)
        calls = plan.calls(text) if plan.constrained else [c.calls[k] for k in sorted(c.calls)]
        if not plan.parallel:
            calls = calls[:1]
        content: str | None = text
        if calls and (plan.constrained or not text.strip()):
            content = None  # the text was the calls
        finish = c.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        return ChatChoice(
            index=c.index,
            message=AssistantMessage(content=content, tool_calls=response_tool_calls(calls)),
            logprobs=chat_logprobs(c.logprobs) if logprobs else None,
            finish_reason=finish,
        )

    async def stream(
        self,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        model: str,
        opened: OpenedStream,
        echo: str,
        ctx: RequestContext,
        session: SessionCall | None = None,
    ) -> AsyncIterator[str]:
        rid, created = random_id("chatcmpl"), int(time.time())
        sampled = Choice(0)  # what a training session records (n is 1 then)
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
            calls = [_StreamedCalls(plan) for _ in range(request.n)]
            async for _, delta in merge([opened]):
                ctx.add_completion(token_count(delta))
                if session is not None:
                    sampled.add_tokens(delta)
                lp = chat_logprobs(delta_logprobs(delta)) if request.logprobs else None
                streamed = calls[delta.index]
                content, pieces = streamed.feed(delta)
                if content or pieces or (lp is not None and lp.content):
                    message = DeltaMessage(content=content or None, tool_calls=pieces or None)
                    if not content and not pieces:
                        message.content = ""
                    yield TokenChunk(
                        chunk(ChatChunkChoice(index=delta.index, delta=message, logprobs=lp))
                    )
                if delta.finish_reason:
                    pieces = streamed.finish()
                    if pieces:
                        yield chunk(
                            ChatChunkChoice(
                                index=delta.index, delta=DeltaMessage(tool_calls=pieces)
                            )
                        )
                    finish = FINISH.get(delta.finish_reason, "stop")
                    if streamed.made and finish == "stop":
                        finish = "tool_calls"
                    if session is not None:
                        reply = reply_message(streamed.content(), streamed.calls())
                        await session.finish(
                            opened.start,
                            sampled.token_ids,
                            sampled.token_logprobs,
                            sampled.finish_code,
                            reply,
                        )
                    yield chunk(
                        ChatChunkChoice(
                            index=delta.index, delta=DeltaMessage(), finish_reason=finish
                        )
                    )
            if include_usage:
                body = ChatCompletionChunk(
                    id=rid, created=created, model=model, choices=[], usage=ctx.usage()
                )
                yield sse(body)
        except (BackendLost, ApiError) as exc:
            yield self.stream_error(exc, ctx)
        finally:
            if session is not None:
                session.release()  # recorded, failed or left by the client
        yield sse("[DONE]")


class _StreamedCalls:
    """One streamed completion's content and tool-call chunks (OpenAI's delta format): the
    sampler's call fragments as they come (auto), the text as the named function's arguments
    (named), or every call once the output is complete (required: its JSON array)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text: list[str] = []
        self.made = False  # a call was sent
        self.named_id = call_id() if plan.mode == "named" else ""
        self.sent: list[str] = []  # content sent
        self.sent_calls: dict[int, dict[str, str]] = {}  # calls sent, by index

    def content(self) -> str:
        return "".join(self.sent)

    def calls(self) -> list[dict[str, str]]:
        """The calls sent, as ``{"id", "name", "arguments"}``."""
        return [self.sent_calls[k] for k in sorted(self.sent_calls)]

    def _keep(self, content: str, pieces: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        self.sent.append(content)
        for piece in pieces:
            call = self.sent_calls.setdefault(
                piece["index"], {"id": "", "name": "", "arguments": ""}
            )
            call["id"] = call["id"] or piece.get("id", "")
            function = piece.get("function") or {}
            call["name"] = call["name"] or function.get("name", "")
            call["arguments"] += function.get("arguments", "")
        return content, pieces

    def feed(self, delta: sampler_pb2.CompletionDelta) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call pieces) of one sampler delta."""
        return self._keep(*self._read(delta))

    def _read(self, delta: sampler_pb2.CompletionDelta) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.mode == "required":
            self.text.append(delta.text)
            return "", []
        if self.plan.mode == "named":
            if not delta.text:
                return "", []
            piece: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
            if not self.made:
                piece.update(id=self.named_id, type="function")
                piece["function"]["name"] = self.plan.name
                self.made = True
            return "", [piece]
        pieces = []
        for fragment in delta.tool_calls:
            if fragment.index > 0 and not self.plan.parallel:
                continue  # parallel_tool_calls false: the first call only
            piece = {"index": fragment.index, "function": {"arguments": fragment.arguments}}
            if fragment.id:
                piece.update(id=fragment.id, type="function")
            if fragment.name:
                piece["function"]["name"] = fragment.name
            pieces.append(piece)
            self.made = True
        return delta.text, pieces

    def finish(self) -> list[dict[str, Any]]:
        """Pieces held until the end (a required choice's calls)."""
        if self.plan.mode != "required":
            return []
        calls = self.plan.calls("".join(self.text))
        self.made = bool(calls)
        pieces = [{"index": k, **call} for k, call in enumerate(response_tool_calls(calls))]
        return self._keep("", pieces)[1]

"""What the completion and chat serving classes share: model names, sampling parameters,
opening the sampler streams (one per prompt), merging them, logprobs and the SSE response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from common import tensor
from gateway import metrics
from gateway.backends import BackendLost, BackendPool, OpenedStream
from gateway.errors import ApiError, BadRequest, ModelNotFound, NoBackend, from_backend
from gateway.limits import KeyLimiter
from gateway.openai.protocol import INT32_MAX, ModelCard, ModelList, SamplingFields, UsageInfo
from gateway.settings import Limits
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import RlfleetError

__all__ = [
    "Choice",
    "OpenAIServing",
    "RequestContext",
    "SSEResponse",
    "TokenChunk",
    "sse",
    "stream_request",
]

log = logging.getLogger(__name__)

FINISH = {
    sampler_pb2.FINISH_REASON_STOP: "stop",
    sampler_pb2.FINISH_REASON_LENGTH: "length",
    sampler_pb2.FINISH_REASON_ABORT: "abort",
}


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    if isinstance(payload, BaseModel):
        # The same compact JSON as json.dumps(model_dump(mode="json")), non-ASCII as UTF-8,
        # in half the time: this runs once per streamed token.
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class TokenChunk(str):
    """An SSE event that carries generated tokens (not the role, an echo or a bare finish):
    the first one handed to ``send`` is the time to first token."""

    __slots__ = ()


class SSEResponse(StreamingResponse):
    """Server-sent events that stop the generation as soon as the client goes away: the body
    runs beside a watcher of ``http.disconnect`` whatever the ASGI version, and cancelling the
    body closes the sampler streams (their ``finally``). The request's bookkeeping (``ctx``)
    ends with the response: the in-flight gauge counts the stream until its last byte is sent
    or its client went away, and token times are taken as ``send`` returns."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], ctx: RequestContext | None = None) -> None:
        self.ctx = ctx
        self._tokens_pending = False  # the chunk being sent is a TokenChunk
        super().__init__(
            self._marked(content) if ctx is not None else content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type="text/event-stream",
        )

    async def _marked(self, content: AsyncIterator[str]) -> AsyncIterator[str]:
        # StreamingResponse sends each chunk as soon as it has it, so the flag names the chunk
        # of the next body message.
        try:
            async for chunk in content:
                self._tokens_pending = isinstance(chunk, TokenChunk)
                yield chunk
        finally:
            close = getattr(content, "aclose", None)
            if close is not None:
                await close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = self.ctx
        timed_send = send
        if ctx is not None:

            async def timed_send(message: Message) -> None:
                await send(message)
                if self._tokens_pending and message["type"] == "http.response.body":
                    self._tokens_pending = False
                    ctx.token_sent(time.monotonic())

        stream = asyncio.ensure_future(self.stream_response(timed_send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            if ctx is not None:
                if not stream.done() or stream.cancelled():
                    ctx.finish("client_disconnected")
                elif stream.exception() is not None:
                    exc = stream.exception()
                    ctx.finish("client_disconnected" if isinstance(exc, OSError) else "internal")
                else:
                    ctx.finish(ctx.error_type)
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            if not isinstance(exc, OSError):
                raise exc  # type: ignore[misc]


@dataclass
class RequestContext:
    """One HTTP request's bookkeeping: its place in the in-flight gauge (``begin`` to
    ``finish``), token times and counts, and the GenAI latency histograms."""

    route: str
    key: KeyLimiter
    started: float = field(default_factory=time.monotonic)
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    error_type: str | None = None  # set by a stream that ended with an error event
    _state: str = "new"  # new -> serving -> finished
    # The route's completion-token counter, looked up once (add_completion runs per delta).
    _completion_counter: Any = field(default=None, repr=False)

    def begin(self, *, stream: bool) -> None:
        self.stream = stream
        self._state = "serving"
        metrics.IN_FLIGHT.inc()

    def finish(self, error_type: str | None = None) -> None:
        """The response is complete (or failed, ``error_type``); the first call counts."""
        if self._state != "serving":
            return
        self._state = "finished"
        metrics.IN_FLIGHT.dec()
        labels = (self.route, "true" if self.stream else "false")
        metrics.REQUEST_DURATION.labels(*labels, error_type or "").observe(
            time.monotonic() - self.started
        )
        if error_type is not None:
            return
        metrics.TOKEN_USAGE.labels(self.route, "input").observe(self.prompt_tokens)
        metrics.TOKEN_USAGE.labels(self.route, "output").observe(self.completion_tokens)
        first, last = self.first_token_at, self.last_token_at
        if first is not None and last is not None and self.completion_tokens > 1:
            metrics.TIME_PER_OUTPUT_TOKEN.labels(*labels).observe(
                (last - first) / (self.completion_tokens - 1)
            )

    def stream_opened(self, opened: OpenedStream) -> None:
        """A sampler started a stream for the request (queue time)."""
        metrics.QUEUE_SECONDS.labels(self.route).observe(opened.started_at - self.started)

    def token_sent(self, at: float) -> None:
        """Tokens reached the client (a stream's chunk handed to ``send``) or, for a
        non-streaming response, the gateway, at ``at`` (time.monotonic())."""
        if self.first_token_at is None:
            self.first_token_at = at
            ttft = at - self.started
            metrics.TTFT_SECONDS.labels(self.route).observe(ttft)
            metrics.TIME_TO_FIRST_TOKEN.labels(
                self.route, "true" if self.stream else "false"
            ).observe(ttft)
        self.last_token_at = at

    def add_prompt(self, count: int) -> None:
        self.prompt_tokens += count
        self.key.charge_tokens(count)
        metrics.PROMPT_TOKENS.labels(self.route).inc(count)

    def add_completion(self, count: int) -> None:
        if count:
            self.completion_tokens += count
            self.key.charge_tokens(count)
            if self._completion_counter is None:
                self._completion_counter = metrics.COMPLETION_TOKENS.labels(self.route)
            self._completion_counter.inc(count)

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


@dataclass
class Choice:
    """One completion being assembled (non-streaming) or tracked (streaming)."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    text_len: int = 0  # characters sent so far (completions' text_offset)
    # Function calls read from the text (chat with tools): index -> {"id", "name", "arguments"}.
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    # The sampled tokens and their logprobs (with SamplingParams.logprobs), and the sampler's
    # finish reason: what a training session records.
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    finish_code: int = 0

    def add_tokens(self, delta: sampler_pb2.CompletionDelta) -> None:
        """Keep a delta's token ids and logprobs."""
        if delta.HasField("token_ids"):
            self.token_ids.extend(tensor.decode(delta.token_ids).tolist())
        if delta.HasField("logprobs"):
            self.token_logprobs.extend(tensor.decode(delta.logprobs).tolist())
        if delta.finish_reason:
            self.finish_code = int(delta.finish_reason)

    def add_calls(self, pieces: Any) -> None:
        """Accumulate a delta's tool-call fragments."""
        for piece in pieces:
            call = self.calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or piece.id
            call["name"] = call["name"] or piece.name
            call["arguments"] += piece.arguments


def delta_logprobs(
    delta: sampler_pb2.CompletionDelta,
) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, logprob, [(top token text, logprob)...]) per new token of a delta."""
    if not delta.HasField("logprobs"):
        return []
    values = tensor.decode(delta.logprobs).tolist()
    texts = list(delta.token_texts) or [""] * len(values)
    tops: list[list[tuple[str, float]]] = [[] for _ in values]
    if delta.HasField("top_logprobs"):
        top = tensor.decode(delta.top_logprobs)
        k = int(top.shape[1]) if top.ndim == 2 else 0
        top_texts = list(delta.top_token_texts)
        for i in range(len(values)):
            row = top[i].tolist() if k else []
            tops[i] = [(top_texts[i * k + j] if top_texts else "", row[j]) for j in range(k)]
    return [(texts[i], float(values[i]), tops[i]) for i in range(len(values))]


def stream_request(
    prompt: sampler_pb2.Prompt, sampling: sampler_pb2.SamplingParams, *, streamed: bool
) -> sampler_pb2.GenerateStreamRequest:
    """The sampler's request for one prompt. A client that does not stream gets the first
    token as it comes (its time to first token is measured) and the rest in one delta at the
    end: a message per token between the processes would only cost CPU."""
    return sampler_pb2.GenerateStreamRequest(
        prompt=prompt,
        sampling=sampling,
        stream_interval=0 if streamed else INT32_MAX,  # no completion is that long
    )


def token_count(delta: sampler_pb2.CompletionDelta) -> int:
    shape = delta.token_ids.shape
    return int(shape[0]) if shape else 0


class OpenAIServing:
    """Base of the serving classes: the pool, the served model names and the limits."""

    prompt_param = "prompt"  # the request field a sampler's prompt error points at
    top_logprobs_param = "logprobs"

    def __init__(self, pool: BackendPool, *, served_model_name: str | None, limits: Limits) -> None:
        self.pool = pool
        self._served_model_name = served_model_name
        self.limits = limits

    # ------------------------------------------------------------------ models

    def model_names(self) -> list[str]:
        info = self.pool.info()
        names = []
        if self._served_model_name:
            names.append(self._served_model_name)
        if info is not None and info.model_name and info.model_name not in names:
            names.append(info.model_name)
        return names

    def models(self) -> ModelList:
        info = self.pool.info()
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    root=info.model_path if info is not None else None,
                    max_model_len=info.max_context_length if info is not None else None,
                )
                for name in self.model_names()
            ]
        )

    def check_model(self, model: str) -> str:
        names = self.model_names()
        if not names:
            raise NoBackend("no sampler has answered yet, so the served model is not known")
        if model not in names:
            raise ModelNotFound(model)
        return names[0]

    # ------------------------------------------------------------------ requests

    def check_common(self, request: SamplingFields) -> None:
        """Fields both APIs reject the same way."""
        if request.logit_bias:
            raise BadRequest("logit_bias is not supported", param="logit_bias")
        if request.n > self.limits.max_n:
            raise BadRequest(f"n must be at most {self.limits.max_n}", param="n")
        stop = request.stop_list()
        if len(stop) > self.limits.max_stop:
            raise BadRequest(f"at most {self.limits.max_stop} stop strings", param="stop")
        if any(not s for s in stop):
            raise BadRequest("stop strings must not be empty", param="stop")
        if request.stream_options is not None and not request.stream:
            raise BadRequest(
                "stream_options is only allowed with stream: true", param="stream_options"
            )

    def max_tokens(self, requested: int | None, param: str) -> int:
        """The sampler's max_tokens (0 = until the context runs out)."""
        cap = self.limits.max_tokens
        if requested == 0:
            raise BadRequest(f"{param} must be at least 1", param=param)
        if requested is not None and cap is not None and requested > cap:
            raise BadRequest(f"{param} must be at most {cap}", param=param)
        return requested if requested is not None else (cap or 0)

    def sampling(
        self, request: SamplingFields, *, max_tokens: int, logprobs: bool, top_logprobs: int
    ) -> sampler_pb2.SamplingParams:
        params = sampler_pb2.SamplingParams(
            n=request.n,
            max_tokens=max_tokens,
            stop=request.stop_list(),
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(request, name)
            if value is not None:
                setattr(params, name, value)
        return params

    def api_error(self, exc: BaseException) -> ApiError:
        return from_backend(
            exc, prompt_param=self.prompt_param, top_logprobs=self.top_logprobs_param
        )

    def stream_error(self, exc: BackendLost | ApiError, ctx: RequestContext) -> str:
        """The SSE event that ends a stream which failed after it began: an OpenAI error object
        without the sampler's own message (from_backend logs it: it names the sampler)."""
        error = self.api_error(exc.error) if isinstance(exc, BackendLost) else exc
        ctx.error_type = error.type
        return sse(error.body())

    async def open_one(
        self, request: sampler_pb2.GenerateStreamRequest, max_tokens: int, ctx: RequestContext
    ) -> OpenedStream:
        """One stream, with the gateway's prompt-length checks on the engine's token count."""
        try:
            opened = await self.pool.open(request)
        except RlfleetError as exc:
            raise self.api_error(exc) from None
        try:
            self.check_prompt_tokens(opened, max_tokens)
        except BaseException:
            await opened.aclose()
            raise
        ctx.stream_opened(opened)
        return opened

    async def open_all(
        self,
        requests: Sequence[sampler_pb2.GenerateStreamRequest],
        max_tokens: int,
        ctx: RequestContext,
    ) -> list[OpenedStream]:
        """Streams for every prompt (concurrently; one failing closes the others)."""
        tasks = [asyncio.ensure_future(self.open_one(r, max_tokens, ctx)) for r in requests]
        try:
            opened = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, OpenedStream):
                    await result.aclose()
            raise
        for stream in opened:
            ctx.add_prompt(stream.prompt_tokens)
        return list(opened)

    def check_prompt_tokens(self, opened: OpenedStream, max_tokens: int) -> None:
        prompt = opened.prompt_tokens
        limit = self.limits.max_prompt_tokens
        if limit is not None and prompt > limit:
            raise BadRequest(
                f"the prompt has {prompt} tokens; this gateway accepts at most {limit}",
                param=self.prompt_param,
                code="context_length_exceeded",
            )
        info = opened.backend.info
        context = info.max_context_length if info is not None else 0
        if context and max_tokens and prompt + max_tokens > context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} "
                "in the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens" if self.prompt_param == "prompt" else "messages",
                code="context_length_exceeded",
            )

    async def collect(
        self,
        request: sampler_pb2.GenerateStreamRequest,
        max_tokens: int,
        ctx: RequestContext,
        opened: OpenedStream | None = None,
    ) -> tuple[OpenedStream, list[Choice]]:
        """Every completion of one prompt, re-run on another backend when the one it ran on
        is lost midway (nothing has been sent to the client yet)."""
        lost: set[Any] = set()
        attempts = 0
        while True:
            attempts += 1
            if opened is None:
                try:
                    opened = await self.pool.open(request, exclude=lost)
                except RlfleetError as exc:
                    raise self.api_error(exc) from None
                try:
                    self.check_prompt_tokens(opened, max_tokens)
                except BaseException:
                    await opened.aclose()
                    raise
            ctx.stream_opened(opened)
            ctx.token_sent(opened.first_delta_at)
            choices = [Choice(i) for i in range(max(1, request.sampling.n))]
            try:
                async for delta in opened:
                    ctx.last_token_at = time.monotonic()
                    choice = choices[delta.index]
                    choice.text.append(delta.text)
                    choice.add_calls(delta.tool_calls)
                    choice.tokens += token_count(delta)
                    choice.add_tokens(delta)
                    if request.sampling.logprobs:
                        choice.logprobs.extend(delta_logprobs(delta))
                    if delta.finish_reason:
                        choice.finish_reason = FINISH.get(delta.finish_reason, "stop")
                ctx.add_prompt(opened.prompt_tokens)
                ctx.add_completion(sum(c.tokens for c in choices))
                return opened, choices
            except BackendLost as exc:
                await opened.aclose()
                if not exc.retryable or attempts >= self.pool.max_attempts:
                    raise self.api_error(exc.error) from None
                log.warning("re-running a request lost on %s: %s", exc.backend.address, exc)
                lost.add(exc.backend)
                opened = None
            finally:
                if opened is not None:
                    await opened.aclose()


async def merge(
    streams: Sequence[OpenedStream],
) -> AsyncIterator[tuple[int, sampler_pb2.CompletionDelta]]:
    """(stream index, delta) from several streams as they come."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: OpenedStream) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
            await queue.put((i, done))
        except BaseException as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

"""``POST /v1/completions``: text or token-id prompts (one or a list), one sampler stream per
prompt; choice ``i`` of prompt ``p`` is OpenAI choice ``p * n + i``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
from fastapi.responses import JSONResponse, Response

from common import tensor
from gateway.backends import BackendLost
from gateway.errors import ApiError, BadRequest
from gateway.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from rlfleet.sampler.v1 import sampler_pb2

__all__ = ["OpenAIServingCompletion"]


class OpenAIServingCompletion(OpenAIServing):
    prompt_param = "prompt"
    top_logprobs_param = "logprobs"

    def prompts(self, request: CompletionRequest) -> list[sampler_pb2.Prompt]:
        raw = request.prompt
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        if not items:
            raise BadRequest("prompt must not be empty", param="prompt")
        if len(items) > self.limits.max_prompts:
            raise BadRequest(
                f"at most {self.limits.max_prompts} prompts per request", param="prompt"
            )
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise BadRequest("prompt must not be empty", param="prompt")
                if len(item) > self.limits.max_prompt_chars:
                    raise BadRequest(
                        f"a prompt has {len(item)} characters; at most "
                        f"{self.limits.max_prompt_chars} are accepted",
                        param="prompt",
                        code="context_length_exceeded",
                    )
                prompts.append(sampler_pb2.Prompt(text=item))
            else:
                if not item:
                    raise BadRequest("prompt must not be empty", param="prompt")
                if any(t < 0 or t >= 2**31 for t in item):
                    raise BadRequest("token ids must be in [0, vocab_size)", param="prompt")
                ids = tensor.encode(np.asarray(item, dtype=np.int32))
                prompts.append(sampler_pb2.Prompt(token_ids=ids))
        return prompts

    def check(self, request: CompletionRequest) -> None:
        self.check_common(request)
        if request.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise BadRequest("best_of must equal n (or be left out)", param="best_of")
        if request.echo and request.logprobs is not None:
            raise BadRequest("echo with logprobs (prompt logprobs) is not supported", param="echo")
        if (
            request.echo
            and not isinstance(request.prompt, str)
            and not (
                isinstance(request.prompt, list) and all(isinstance(p, str) for p in request.prompt)
            )
        ):
            raise BadRequest("echo needs text prompts", param="echo")

    async def create(self, request: CompletionRequest, ctx: RequestContext) -> Response:
        model = self.check_model(request.model)
        self.check(request)
        prompts = self.prompts(request)
        max_tokens = self.max_tokens(request.max_tokens, "max_tokens")
        logprobs = request.logprobs is not None
        sampling = self.sampling(
            request, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=request.logprobs or 0
        )
        requests = [stream_request(p, sampling, streamed=request.stream) for p in prompts]
        echoes = [p.text if request.echo else "" for p in prompts]
        if request.stream:
            streams = await self.open_all(requests, max_tokens, ctx)
            return SSEResponse(self.stream(request, model, streams, echoes, ctx), ctx)
        results = await asyncio.gather(
            *(self.collect(r, max_tokens, ctx) for r in requests), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        choices = []
        for p, result in enumerate(results):
            assert not isinstance(result, BaseException)
            _, prompt_choices = result
            for choice in prompt_choices:
                choices.append(
                    self.final_choice(p * request.n + choice.index, choice, echoes[p], logprobs)
                )
        body = CompletionResponse(model=model, choices=choices, usage=ctx.usage())
        return JSONResponse(body.model_dump(mode="json"))

    @staticmethod
    def logprobs_of(choice: Choice, offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, logprob, top in choice.logprobs:
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            tops = dict(top)
            tops.setdefault(token, logprob)
            out.top_logprobs.append(tops)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def final_choice(
        self, index: int, choice: Choice, echo: str, logprobs: bool
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=echo + "".join(choice.text),
            logprobs=self.logprobs_of(choice, len(echo)) if logprobs else None,
            finish_reason=choice.finish_reason,
        )

    async def stream(
        self,
        request: CompletionRequest,
        model: str,
        streams: list,
        echoes: list[str],
        ctx: RequestContext,
    ) -> AsyncIterator[str]:
        rid, created, n = random_id("cmpl"), int(time.time()), request.n
        logprobs = request.logprobs is not None
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        offsets: dict[int, int] = {}

        def chunk(choices: list[CompletionChoice]) -> str:
            usage = ctx.usage() if continuous else None
            return sse(
                CompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
            )

        try:
            for p, echo in enumerate(echoes):
                if echo:
                    for i in range(n):
                        offsets[p * n + i] = len(echo)
                        yield chunk([CompletionChoice(index=p * n + i, text=echo)])
            async for p, delta in merge(streams):
                index = p * n + delta.index
                ctx.add_completion(token_count(delta))
                finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
                if not delta.text and finish is None and not delta.token_ids.shape:
                    continue
                lp = None
                if logprobs:
                    part = Choice(index, logprobs=delta_logprobs(delta))
                    lp = self.logprobs_of(part, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                out = chunk(
                    [
                        CompletionChoice(
                            index=index, text=delta.text, logprobs=lp, finish_reason=finish
                        )
                    ]
                )
                yield TokenChunk(out) if delta.text or (lp and lp.tokens) else out
            if include_usage:
                yield sse(
                    CompletionChunk(
                        id=rid, created=created, model=model, choices=[], usage=ctx.usage()
                    )
                )
        except (BackendLost, ApiError) as exc:
            yield self.stream_error(exc, ctx)
        yield sse("[DONE]")

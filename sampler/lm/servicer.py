"""`rlfleet.sampler.v1.SamplerService` over a GenerationEngine.

The servicer exists before the engine does (vLLM is slow to start): until `attach`
hands it the engine and the first weight version is in, Generate answers UNAVAILABLE and
GetInfo answers with what the settings already say. Weight versions go through the VersionGate
(gate.py), which is also where Completion.policy_version comes from.

GenerateStream runs one engine request (`GenerationEngine.stream`) and turns its token Deltas
into CompletionDeltas: the text of a delta is what decoding the completion's tokens so far adds,
minus whatever may still become a stop string (or is an incomplete UTF-8 character), so the
concatenated texts equal Generate's `text`. The call's cancellation closes the engine stream,
which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from common import tensor
from common.images import image_token_ids
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from sampler.engines.base import Completion, Delta, GenerationEngine, SamplingOptions
from sampler.lm.gate import VersionGate
from sampler.lm.requests import (
    Limits,
    PromptRenderer,
    Rendered,
    parse_request,
    parse_stream_request,
)
from sampler.lm.tool_calls import ToolCallReader
from services.errors import InvalidArgument, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    import torch

    from sampler.lm.settings import SamplerSettings

__all__ = ["SamplerService"]

log = logging.getLogger(__name__)

_FINISH = {
    "stop": sampler_pb2.FINISH_REASON_STOP,
    "length": sampler_pb2.FINISH_REASON_LENGTH,
    "abort": sampler_pb2.FINISH_REASON_ABORT,
}
_KINDS = {"vllm": sampler_pb2.ENGINE_KIND_VLLM, "hf": sampler_pb2.ENGINE_KIND_HF}


class SamplerService(sampler_pb2_grpc.SamplerServiceServicer):
    """Generate and GetInfo; `attach` the engine, then `set_ready` once weights are in."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all):
    # rollout drivers and the gateway.
    CALLERS = dict.fromkeys(
        ("Generate", "GenerateStream", "GetInfo"), frozenset({"rollout", "gateway"})
    )

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings
        self.engine: GenerationEngine | None = None
        self.renderer: PromptRenderer | None = None
        self.tool_calls: ToolCallReader | None = None  # with the renderer, by `attach`
        self.suppressed: tuple[int, ...] = ()  # token ids no request may sample, by `attach`
        self.limits: Limits | None = None
        self.gate = VersionGate(0)
        self.ready = False
        self.waiting_for = "the engine to start"  # what Generate's UNAVAILABLE says
        self.queued = 0  # engine requests (prompts) admitted and not finished

    def attach(self, engine: GenerationEngine, tokenizer: object, processor: object = None) -> None:
        """The engine is up (with the weights from disk, version 0); ``processor``: a
        vision-language model's, which expands the images of prompts."""
        self.engine = engine
        self.renderer = PromptRenderer(tokenizer, processor)
        # A vision-language model never writes its image markers (common.images).
        self.suppressed = image_token_ids(processor) if processor is not None else ()
        self.tool_calls = ToolCallReader(tokenizer, self.settings.tool_parser)
        info = engine.info
        self.limits = Limits(
            max_n=self.settings.max_n,
            max_prompts=self.settings.max_prompts_per_request,
            max_context=info.max_model_len,
            vocab_size=info.vocab_size,
            max_images=info.max_images if processor is not None else 0,
        )

    def set_ready(self) -> None:
        self.ready = True
        # Freeze the start-up heap (torch, vLLM, transformers: a full collection over it pauses
        # every open stream), as vLLM's engine core does for its own process.
        gc.collect()
        gc.freeze()

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Apply a version: after the generations running now, before any that arrive now."""
        assert self.engine is not None
        async with self.gate.writing():
            started = time.monotonic()
            await self.engine.load_weights(tensors, version)
            self.gate.version = version
        took_ms = 1e3 * (time.monotonic() - started)
        log.info("serving weights v%d (loaded in %.0f ms)", version, took_ms)

    async def warm_up(self) -> float:
        """Generate once before reporting SERVING (the first requests of a fresh engine are
        slow while vLLM compiles): a greedy request and a seeded sampled one with logprobs, run
        together so that batched decoding is warmed too. Returns the seconds it took."""
        assert self.engine is not None and self.renderer is not None and self.limits is not None
        started = time.monotonic()
        prompt = list(self.renderer.tokenizer("Warm-up: 1, 2, 3,")["input_ids"]) or [0]
        prompt = prompt[: max(1, self.limits.max_context - 8)]
        room = self.limits.max_context - len(prompt)
        greedy = SamplingOptions(max_tokens=[min(4, room)], temperature=0.0)
        sampled = dataclasses.replace(
            greedy, n=min(2, self.settings.max_n), temperature=1.0, seed=0, logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        await asyncio.gather(
            self.engine.generate([prompt], greedy), self.engine.generate([prompt], sampled)
        )
        seconds = time.monotonic() - started
        log.info("engine warmed up in %.1fs", seconds)
        return seconds

    def _options(self, options: SamplingOptions) -> SamplingOptions:
        """The request's options checked against the engine, with what every request of this
        model gets (the suppressed tokens)."""
        self._check_format(options)
        if not self.suppressed:
            return options
        return dataclasses.replace(options, suppressed_token_ids=self.suppressed)

    def _check_format(self, options: SamplingOptions) -> None:
        assert self.engine is not None
        if options.structured_output is not None and not self.engine.info.structured_output:
            raise InvalidArgument(
                f"sampling.structured_output: the {self.engine.info.kind} engine cannot "
                "constrain its output (the vllm engine can)",
                field="sampling.structured_output",
            )

    def _check_ready(self) -> None:
        if not self.ready or self.engine is None:
            raise Unavailable(f"sampler not ready: waiting for {self.waiting_for}; retry later")

    def _admit(self, count: int) -> None:
        limit = self.settings.max_queued_requests
        if self.queued + count > limit:
            raise ResourceExhausted(
                f"the engine's queue is full ({self.queued} requests waiting or running, "
                f"max_queued_requests={limit}); retry later"
            )
        self.queued += count

    async def Generate(
        self, request: sampler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GenerateResponse:
        received = time.monotonic()
        self._check_ready()
        assert self.engine is not None
        assert self.renderer is not None and self.limits is not None
        prompts, parsed = parse_request(request, self.limits, self.renderer, received)
        options = self._options(parsed)
        tools = [
            self.renderer.tools(p.chat, f"prompts[{i}].chat") if p.HasField("chat") else []
            for i, p in enumerate(request.prompts)
        ]
        self._admit(len(prompts))
        try:
            async with self.gate.reading() as version:
                results = await _generate(self.engine, prompts, options)
        finally:
            self.queued -= len(prompts)
        response = sampler_pb2.GenerateResponse()
        for prompt, completions, listed in zip(prompts, results, tools, strict=True):
            result = response.results.add()
            result.prompt_token_ids.CopyFrom(tensor.encode(np.asarray(prompt.ids, np.int32)))
            if completions:
                result.cached_prompt_tokens = completions[0].cached_prompt_tokens
            for completion in completions:
                out = result.completions.add()
                _fill(out, completion, version, options)
                if listed:
                    assert self.tool_calls is not None
                    out.text, calls = self.tool_calls.parse(out.text, listed)
                    out.tool_calls.extend(calls)
        return response

    async def GenerateStream(
        self, request: sampler_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]:
        received = time.monotonic()
        self._check_ready()
        assert self.engine is not None
        assert self.renderer is not None and self.limits is not None
        prompt, parsed = parse_stream_request(request, self.limits, self.renderer, received)
        options = self._options(parsed)
        listed = self.renderer.tools(request.prompt.chat) if request.prompt.HasField("chat") else []
        # Greedy n > 1: one engine completion, sent under every index (as Generate does).
        copies = options.n if options.temperature == 0 and options.n > 1 else 1
        engine_options = dataclasses.replace(options, n=1) if copies > 1 else options
        tokenizer = self.renderer.tokenizer
        texts = [_StreamText(tokenizer, options.stop) for _ in range(engine_options.n)]
        assert self.tool_calls is not None
        readers = [self.tool_calls.stream(listed) if listed else None for _ in texts]
        self._admit(1)
        try:
            async with self.gate.reading() as version:
                start = sampler_pb2.StreamStart(
                    prompt_token_ids=tensor.encode(np.asarray(prompt.ids, np.int32)),
                    policy_version=version,
                )
                yield sampler_pb2.GenerateStreamResponse(start=start)
                stream = self.engine.stream(prompt.ids, engine_options, prompt.images)
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    async for batch in stream:
                        for delta in batch:
                            out = _delta_message(delta, texts[delta.index], tokenizer, options)
                            reader = readers[delta.index]
                            if reader is not None:  # calls out of the text, as decided
                                out.text, calls = reader.feed(out.text, delta.token_ids)
                                out.tool_calls.extend(calls)
                            for index in range(copies) if copies > 1 else (delta.index,):
                                message = sampler_pb2.GenerateStreamResponse(delta=out)
                                message.delta.index = index
                                yield message
        finally:
            self.queued -= 1

    async def GetInfo(
        self, request: sampler_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GetInfoResponse:
        s = self.settings
        reply = sampler_pb2.GetInfoResponse(
            model_name=s.served_model_name or s.model_path,
            model_path=s.model_path,
            policy_version=self.gate.version,
            engine_kind=_KINDS[s.engine],
            max_n=s.max_n,
            max_prompts_per_request=s.max_prompts_per_request,
        )
        if self.engine is not None and self.renderer is not None:
            info = self.engine.info
            reply.max_context_length = info.max_model_len
            reply.engine_version = info.version
            reply.has_chat_template = self.renderer.has_chat_template
            reply.eos_token_ids.extend(info.eos_token_ids)
            reply.vocab_size = info.vocab_size
            reply.prefix_caching = info.prefix_caching
        if self.limits is not None:
            reply.max_images_per_prompt = self.limits.max_images
        return reply


async def _generate(
    engine: GenerationEngine, prompts: list[Rendered], options: SamplingOptions
) -> list[list[Completion]]:
    """Greedy decoding gives one answer however often it is asked (vLLM refuses n > 1 with
    temperature 0): generate once per prompt and repeat it n times."""
    ids = [p.ids for p in prompts]
    # Text-only requests keep the engine call they always made.
    images = [p.images for p in prompts] if any(p.images for p in prompts) else None
    if options.temperature > 0 or options.n == 1:
        return await engine.generate(ids, options, images)
    once = await engine.generate(ids, dataclasses.replace(options, n=1), images)
    return [[copy.deepcopy(c[0]) for _ in range(options.n)] for c in once]


class _StreamText:
    """One streamed completion's text: decode all its tokens so far and send what is new and
    decided. Held back until the completion ends: a trailing incomplete UTF-8 character (decoded
    as U+FFFD) and any tail that is the beginning of a stop string. At the end the text is cut
    before the first stop string, as Generate's is."""

    _CONTEXT = 8  # tokens decoded again before the checkpoint (leading-space rules)
    _CHECKPOINT_EVERY = 16  # tokens

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.sent = ""
        # The text of tokens[:base_len], so that a step decodes only the tokens after it
        # (and a little context) instead of the whole completion.
        self.base_len = 0
        self.base_text = ""
        self._head: tuple[int, int, str] = (0, 0, "")  # (start, base_len, decoded) cache

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _text(self, finished: bool) -> str:
        if finished:  # exactly Generate's text
            return self._decode(self.tokens)
        start = max(0, self.base_len - self._CONTEXT)
        if self._head[:2] != (start, self.base_len):  # decoded once per checkpoint
            self._head = (start, self.base_len, self._decode(self.tokens[start : self.base_len]))
        head = self._head[2]
        window = self._decode(self.tokens[start:])
        if window.startswith(head):
            text = self.base_text + window[len(head) :]
        else:
            text = self._decode(self.tokens)
        if len(self.tokens) - self.base_len >= self._CHECKPOINT_EVERY and not text.endswith(
            "\ufffd"
        ):
            self.base_len, self.base_text = len(self.tokens), text
        return text

    def add(self, token_ids: Sequence[int], finished: bool) -> str:
        self.tokens.extend(token_ids)
        if not token_ids and not finished:
            return ""
        text = self._text(finished)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        end = min(hits, default=len(text))
        if not finished:
            end = min(end, len(text.rstrip("\ufffd")))
            end -= _stop_prefix(text[:end], self.stop)
        if end <= len(self.sent) or not text.startswith(self.sent):
            # Nothing new, or the decoding of earlier tokens changed (never for byte-level
            # BPE): what was sent stays sent.
            new = text[len(self.sent) : end] if finished and end > len(self.sent) else ""
        else:
            new = text[len(self.sent) : end]
        self.sent += new
        return new


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper beginning of a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def _delta_message(
    d: Delta, text: _StreamText, tokenizer: Any, options: SamplingOptions
) -> sampler_pb2.CompletionDelta:
    out = sampler_pb2.CompletionDelta(index=d.index)
    out.token_ids.CopyFrom(tensor.encode(np.asarray(d.token_ids, np.int32)))
    out.text = text.add(d.token_ids, d.finish_reason is not None)
    if d.finish_reason is not None:
        out.finish_reason = _FINISH[d.finish_reason]
    if options.logprobs or options.top_logprobs:
        out.token_texts.extend(_token_text(tokenizer, t) for t in d.token_ids)
    if options.logprobs:
        out.logprobs.CopyFrom(tensor.encode(np.asarray(d.logprobs or [], np.float32)))
    if options.top_logprobs:
        shape = (len(d.token_ids), options.top_logprobs)
        ids = np.asarray(d.top_token_ids or [], np.int32).reshape(shape)
        values = np.asarray(d.top_logprobs or [], np.float32).reshape(shape)
        out.top_token_ids.CopyFrom(tensor.encode(ids))
        out.top_logprobs.CopyFrom(tensor.encode(values))
        out.top_token_texts.extend(_token_text(tokenizer, int(t)) for t in ids.reshape(-1))
    return out


def _token_text(tokenizer: Any, token_id: int) -> str:
    """One token decoded on its own (special tokens as their text), cached per tokenizer."""
    cache: dict[int, str] | None = getattr(tokenizer, "_rlfleet_token_texts", None)
    if cache is None:
        cache = {}
        with contextlib.suppress(AttributeError):
            tokenizer._rlfleet_token_texts = cache
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def _fill(
    out: sampler_pb2.Completion, c: Completion, version: int, options: SamplingOptions
) -> None:
    out.token_ids.CopyFrom(tensor.encode(np.asarray(c.token_ids, np.int32)))
    out.text = c.text
    out.finish_reason = _FINISH[c.finish_reason]
    # The gate keeps a generation on one version from its first token to its last.
    out.policy_version = out.end_policy_version = version
    if options.logprobs:
        out.logprobs.CopyFrom(tensor.encode(np.asarray(c.logprobs or [], np.float32)))
    if options.top_logprobs:
        shape = (len(c.token_ids), options.top_logprobs)
        ids = np.asarray(c.top_token_ids or [], np.int32).reshape(shape)
        values = np.asarray(c.top_logprobs or [], np.float32).reshape(shape)
        out.top_token_ids.CopyFrom(tensor.encode(ids))
        out.top_logprobs.CopyFrom(tensor.encode(values))

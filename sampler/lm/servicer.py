"""`rlfleet.sampler.v1.SamplerService` over a GenerationEngine.

The servicer exists before the engine does (vLLM takes 15-60 s to start): until `attach`
hands it the engine and the first weight version is in, Generate answers UNAVAILABLE and
GetInfo answers with what the settings already say. Weight versions go through the VersionGate
(gate.py), which is also where Completion.policy_version comes from.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc
import numpy as np

from common import tensor
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from sampler.engines.base import Completion, GenerationEngine, SamplingOptions
from sampler.lm.gate import VersionGate
from sampler.lm.requests import Limits, PromptRenderer, parse_request
from services.errors import ResourceExhausted, Unavailable

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

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings
        self.engine: GenerationEngine | None = None
        self.renderer: PromptRenderer | None = None
        self.limits: Limits | None = None
        self.gate = VersionGate(0)
        self.ready = False
        self.waiting_for = "the engine to start"  # what Generate's UNAVAILABLE says
        self.queued = 0  # engine requests (prompts) admitted and not finished

    def attach(self, engine: GenerationEngine, tokenizer: object) -> None:
        """The engine is up (with the weights from disk, version 0)."""
        self.engine = engine
        self.renderer = PromptRenderer(tokenizer)
        info = engine.info
        self.limits = Limits(
            max_n=self.settings.max_n,
            max_prompts=self.settings.max_prompts_per_request,
            max_context=info.max_model_len,
            vocab_size=info.vocab_size,
        )

    def set_ready(self) -> None:
        self.ready = True

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Apply a version: after the generations running now, before any that arrive now."""
        assert self.engine is not None
        async with self.gate.writing():
            started = time.monotonic()
            await self.engine.load_weights(tensors, version)
            self.gate.version = version
        took_ms = 1e3 * (time.monotonic() - started)
        log.info("serving weights v%d (loaded in %.0f ms)", version, took_ms)

    async def Generate(
        self, request: sampler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.GenerateResponse:
        received = time.monotonic()
        if not self.ready or self.engine is None:
            raise Unavailable(f"sampler not ready: waiting for {self.waiting_for}; retry later")
        assert self.renderer is not None and self.limits is not None
        prompts, options = parse_request(request, self.limits, self.renderer, received)
        limit = self.settings.max_queued_requests
        if self.queued + len(prompts) > limit:
            raise ResourceExhausted(
                f"the engine's queue is full ({self.queued} requests waiting or running, "
                f"max_queued_requests={limit}); retry later"
            )
        self.queued += len(prompts)
        try:
            async with self.gate.reading() as version:
                results = await _generate(self.engine, prompts, options)
        finally:
            self.queued -= len(prompts)
        response = sampler_pb2.GenerateResponse()
        for prompt, completions in zip(prompts, results, strict=True):
            result = response.results.add()
            result.prompt_token_ids.CopyFrom(tensor.encode(np.asarray(prompt, np.int32)))
            for completion in completions:
                _fill(result.completions.add(), completion, version, options)
        return response

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
        return reply


async def _generate(
    engine: GenerationEngine, prompts: list[list[int]], options: SamplingOptions
) -> list[list[Completion]]:
    """Greedy decoding gives one answer however often it is asked (vLLM refuses n > 1 with
    temperature 0): generate once per prompt and repeat it n times."""
    if options.temperature > 0 or options.n == 1:
        return await engine.generate(prompts, options)
    once = await engine.generate(prompts, dataclasses.replace(options, n=1))
    return [[copy.deepcopy(c[0]) for _ in range(options.n)] for c in once]


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

"""Client side of `SamplerService`, for rollout drivers and benchmarks.

    async with SamplerClient("127.0.0.1:50051") as sampler:
        reply = await sampler.generate(["Q: 1+2=?\nA:"], n=8, max_tokens=16, logprobs=True)
        info = await sampler.info()

A prompt is a str (text), a sequence or numpy array of token ids, a list of chat messages
({"role", "content"} dicts), or a ready `sampler_pb2.Prompt`. Errors come back as the
services.errors class the server raised (InvalidArgument with its field, ResourceExhausted...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import duration_pb2

from common import tensor
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.errors import from_rpc_error
from services.server import channel

__all__ = ["PromptLike", "SamplerClient", "to_prompt"]

PromptLike = str | Sequence[int] | np.ndarray | Sequence[Mapping[str, str]] | sampler_pb2.Prompt


def to_prompt(prompt: PromptLike) -> sampler_pb2.Prompt:
    """One of the accepted prompt forms as a Prompt message."""
    if isinstance(prompt, sampler_pb2.Prompt):
        return prompt
    if isinstance(prompt, str):
        return sampler_pb2.Prompt(text=prompt)
    if isinstance(prompt, np.ndarray) or (prompt and isinstance(prompt[0], int | np.integer)):
        ids = np.asarray(prompt, dtype=np.int32)
        return sampler_pb2.Prompt(token_ids=tensor.encode(ids))
    messages = [sampler_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
    return sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt(messages=messages))


class SamplerClient:
    """An async SamplerService client over one channel."""

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        self.address = address
        self.timeout_s = timeout_s  # gRPC deadline of each call
        self._channel = channel(address)
        self._stub = sampler_pb2_grpc.SamplerServiceStub(self._channel)

    async def generate(
        self,
        prompts: Sequence[PromptLike],
        *,
        timeout: float | None = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> sampler_pb2.GenerateResponse:
        """Generate for `prompts`; `sampling` are SamplingParams fields (n, temperature,
        max_tokens, stop, seed, logprobs, top_logprobs, ...). `timeout` (seconds) is the
        server-side budget that returns partial completions (FINISH_REASON_ABORT);
        `deadline_s` overrides the gRPC deadline, which fails the call instead."""
        request = sampler_pb2.GenerateRequest(
            prompts=[to_prompt(p) for p in prompts],
            sampling=sampler_pb2.SamplingParams(**sampling),
        )
        if timeout is not None:
            request.timeout.CopyFrom(_duration(timeout))
        return await self._call(self._stub.Generate, request, deadline_s)

    async def info(self) -> sampler_pb2.GetInfoResponse:
        """What the sampler serves (model, context length, weight version, engine)."""
        return await self._call(self._stub.GetInfo, sampler_pb2.GetInfoRequest(), 30.0)

    async def _call(self, method: Any, request: Any, deadline_s: float | None) -> Any:
        try:
            return await method(request, timeout=deadline_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration

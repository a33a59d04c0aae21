"""Client side of `SamplerService`, for rollout drivers, benchmarks and tests.

    async with SamplerClient("127.0.0.1:50051") as sampler:
        reply = await sampler.generate(["Q: 1+2=?\nA:"], n=8, max_tokens=16, logprobs=True)
        info = await sampler.info()

A prompt is a str (text), a sequence or numpy array of token ids, a list of chat messages
({"role", "content"} dicts), or a ready `sampler_pb2.Prompt`; `generate_request` sends a
GenerateRequest as it is. `SamplerPool` spreads calls over replicas in turn.

Errors come back as the services.errors class the server raised (InvalidArgument with its
field, ResourceExhausted...), the message prefixed with the sampler and the method
("sampler 127.0.0.1:50051: Generate: ..."); services.calls.call_with_retry decides what is
worth retrying.

The sampler's client module: other services import the sampler only through this one, and it
imports only the contracts (rlfleet.*), the runtime (services.*) and common.*.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import duration_pb2

from common import tensor
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.calls import rpc
from services.grpc_names import service_name
from services.server import channel

__all__ = ["SERVICE_NAME", "PromptLike", "SamplerClient", "SamplerPool", "to_prompt"]

SERVICE_NAME = service_name(sampler_pb2, "SamplerService")  # for health checks

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
    """An async SamplerService client over one channel; close it (or use ``async with``)."""

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        self.address = address
        self.timeout_s = timeout_s  # gRPC deadline of each Generate call
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
        return await self.generate_request(request, deadline_s=deadline_s)

    async def generate_request(
        self, request: sampler_pb2.GenerateRequest, *, deadline_s: float | None = None
    ) -> sampler_pb2.GenerateResponse:
        """Send a ready GenerateRequest; `deadline_s` overrides the client's gRPC deadline."""
        call = self._stub.Generate(request, timeout=deadline_s or self.timeout_s)
        return await rpc(f"sampler {self.address}: Generate", call)

    async def info(self) -> sampler_pb2.GetInfoResponse:
        """What the sampler serves (model, context length, weight version, engine)."""
        call = self._stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=30.0)
        return await rpc(f"sampler {self.address}: GetInfo", call)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class SamplerPool:
    """Generate on several samplers in turn (one call each), so replicas share the load."""

    def __init__(self, addresses: Sequence[str], *, timeout_s: float = 600.0) -> None:
        if not addresses:
            raise ValueError("SamplerPool: no sampler addresses")
        self.clients = [SamplerClient(address, timeout_s=timeout_s) for address in addresses]
        self._turn = itertools.cycle(range(len(self.clients)))

    @property
    def addresses(self) -> list[str]:
        return [client.address for client in self.clients]

    async def generate(
        self, request: sampler_pb2.GenerateRequest
    ) -> tuple[str, sampler_pb2.GenerateResponse]:
        """(address that answered, response) from the next sampler in turn."""
        client = self.clients[next(self._turn)]
        return client.address, await client.generate_request(request)

    async def info(self, index: int = 0) -> sampler_pb2.GetInfoResponse:
        """GetInfo of the ``index``-th sampler."""
        return await self.clients[index].info()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def __aenter__(self) -> SamplerPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration

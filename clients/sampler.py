"""Client side of `SamplerService`, for rollout drivers, benchmarks and tests.

    async with SamplerClient("127.0.0.1:50051") as sampler:
        reply = await sampler.generate(["Q: 1+2=?\nA:"], n=8, max_tokens=16, logprobs=True)
        info = await sampler.info()
        async for message in sampler.stream(sampler_pb2.GenerateStreamRequest(...)):
            ...  # `start`, then `delta`s; closing the iterator cancels the generation

A prompt is a str (text), a sequence or numpy array of token ids, a list of chat messages
({"role", "content"} dicts), or a ready `sampler_pb2.Prompt`; `generate_request` sends a
GenerateRequest as it is. `SamplerPool` spreads calls over replicas, the least busy first.

Errors come back as the services.errors class the server raised (InvalidArgument with its
field, ResourceExhausted...), the message prefixed with the sampler and the method
("sampler 127.0.0.1:50051: Generate: ..."); services.calls.call_with_retry decides what is
worth retrying.

The sampler's client module: other services import the sampler only through this one, and it
imports only the contracts (rlfleet.*), the runtime (services.*) and common.*.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf import duration_pb2

from common import tensor
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.calls import rpc
from services.errors import RlfleetError, from_rpc_error
from services.grpc_names import service_name
from services.membership import Balancer, PeerView
from services.server import channel

__all__ = [
    "SERVICE_NAME",
    "PromptLike",
    "SamplerClient",
    "SamplerPool",
    "chat_message",
    "to_prompt",
]

SERVICE_NAME = service_name(sampler_pb2, "SamplerService")  # for health checks

PromptLike = str | Sequence[int] | np.ndarray | Sequence[Mapping[str, Any]] | sampler_pb2.Prompt


def chat_message(
    message: Mapping[str, Any], images: Iterator[sampler_pb2.Image] | None = None
) -> sampler_pb2.ChatMessage:
    """A chat message (OpenAI's shape) as a ChatMessage. Content parts: ``{"type": "text",
    "text": ...}`` and ``{"type": "image", "image": <encoded bytes>}``; an image part without
    bytes (a dataset's placeholder) takes the next of ``images``."""
    role, content = str(message["role"]), message.get("content")
    if content is None or isinstance(content, str):
        return sampler_pb2.ChatMessage(role=role, content=content or "")
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(sampler_pb2.ContentPart(text=str(part.get("text", ""))))
        elif kind == "image" and isinstance(part.get("image"), bytes):
            parts.append(sampler_pb2.ContentPart(image=sampler_pb2.Image(data=part["image"])))
        elif kind == "image" and images is not None:
            image = next(images, None)
            if image is None:
                raise ValueError("more image parts in the messages than images given")
            parts.append(sampler_pb2.ContentPart(image=image))
        else:
            raise ValueError(f"a content part of type {kind!r} without what it needs")
    return sampler_pb2.ChatMessage(role=role, parts=parts)


def to_prompt(prompt: PromptLike) -> sampler_pb2.Prompt:
    """One of the accepted prompt forms as a Prompt message."""
    if isinstance(prompt, sampler_pb2.Prompt):
        return prompt
    if isinstance(prompt, str):
        return sampler_pb2.Prompt(text=prompt)
    if isinstance(prompt, np.ndarray) or (prompt and isinstance(prompt[0], int | np.integer)):
        ids = np.asarray(prompt, dtype=np.int32)
        return sampler_pb2.Prompt(token_ids=tensor.encode(ids))
    chat = cast("Sequence[Mapping[str, Any]]", prompt)  # the one form left: chat messages
    messages = [chat_message(m) for m in chat]
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

    def stream(
        self, request: sampler_pb2.GenerateStreamRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]:
        """The messages of a GenerateStream call (``start``, then ``delta``s), as they come.

        `timeout_s` overrides the client's gRPC deadline. A failure (before or during the
        stream) raises the services.errors class the server sent. Closing the iterator
        (``aclose``, leaving an ``async with contextlib.aclosing(...)`` block) or dropping it
        before the end cancels the call, and the server aborts the generation.

            async for message in sampler.stream(request):
                if message.HasField("delta"): ...
        """
        call = self._stub.GenerateStream(request, timeout=timeout_s or self.timeout_s)
        return _ResponseStream(f"sampler {self.address}: GenerateStream", call)

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
    """Generate on the samplers ``peers`` names (fixed addresses, or an instance's live
    replicas: services/membership.py), each call on the one with the fewest calls in flight."""

    def __init__(self, peers: Sequence[str] | PeerView, *, timeout_s: float = 600.0) -> None:
        if not isinstance(peers, PeerView):
            if not peers:
                raise ValueError("SamplerPool: no sampler addresses")
            peers = PeerView(list(peers), kind="sampler", resolve=str)
        self.balancer = Balancer(
            peers, lambda a: SamplerClient(a, timeout_s=timeout_s), SamplerClient.close
        )

    @property
    def addresses(self) -> list[str]:
        return self.balancer.addresses

    async def generate(
        self, request: sampler_pb2.GenerateRequest
    ) -> tuple[str, sampler_pb2.GenerateResponse]:
        """(address that answered, response) from the least busy sampler."""
        async with self.balancer.use() as (address, client):
            return address, await client.generate_request(request)

    async def info(self, index: int = 0) -> sampler_pb2.GetInfoResponse:
        """GetInfo of the ``index``-th sampler in use."""
        return await self.balancer.client(self.addresses[index]).info()

    async def close(self) -> None:
        await self.balancer.close()

    async def __aenter__(self) -> SamplerPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _ResponseStream(AsyncIterator[sampler_pb2.GenerateStreamResponse]):
    """A server-streaming call as an async iterator that cancels the call when closed or
    garbage-collected before its end (an async generator would only do that once iterated and
    finalized by the event loop)."""

    def __init__(self, what: str, call: Any) -> None:
        self._what = what
        self._call = call
        self._done = False

    def __aiter__(self) -> _ResponseStream:
        return self

    async def __anext__(self) -> sampler_pb2.GenerateStreamResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            self._done = True
            raise _client_error(self._what, exc) from None
        except asyncio.CancelledError:
            # The reading task was cancelled (or the call was, by aclose from another task).
            closed = self._done
            self._finish()
            if closed:
                raise StopAsyncIteration from None
            raise
        if message is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        return message  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Cancel the call if it has not ended (idempotent)."""
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._call.cancel()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # the loop may be gone at interpreter exit
                self._call.cancel()


def _client_error(what: str, exc: grpc.RpcError) -> RlfleetError:
    error = from_rpc_error(exc)
    error.message = f"{what}: {error.message}"
    error.args = (error.message,)
    return error


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration

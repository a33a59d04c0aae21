"""Helpers for the gateway tests (no tests here): a gateway app served by uvicorn on a free
port from a thread of its own (so the sync `openai` client can call it), and a fake replica
for the unit tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from common import tensor
from gateway.app import Gateway, HttpServer, build_app
from gateway.settings import GatewaySettings
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument, RlfleetError, Unavailable


class ThreadedGateway:
    """A gateway (pool started, HTTP listening) on an event loop in a daemon thread."""

    def __init__(
        self,
        settings: GatewaySettings,
        replicas: list[Any] | None = None,
        addresses: list[str] | None = None,
        wait_healthy_s: float = 60.0,
        *,
        nats_url: str | None = None,
        run: str = "gateway-test",
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus: Any = None
        self.gateway: Gateway = self.call(
            self._start(settings, replicas, addresses, wait_healthy_s, nats_url, run)
        )

    async def _start(
        self,
        settings: GatewaySettings,
        replicas: Any,
        addresses: Any,
        wait_s: float,
        nats_url: str | None,
        run: str,
    ) -> Gateway:
        gateway = Gateway.create(settings, replicas, addresses=addresses)
        await gateway.pool.start()
        await gateway.pool.wait_healthy(wait_s)
        if settings.training is not None:  # as the service starts it, on the run's bus
            from gateway.training.trainer import start_training
            from services.bus import Bus

            assert nats_url is not None, "the training mode needs a bus"
            self.bus = await Bus.connect(nats_url, name="gateway-test")
            self.stop_event = asyncio.Event()
            gateway.training = await start_training(
                gateway, self.bus, run, "gateway", self.stop_event
            )
        self.http = HttpServer(build_app(gateway), settings, host="127.0.0.1", port=0)
        await self.http.start()
        return gateway

    @property
    def url(self) -> str:
        return self.http.url

    def call(self, coro: Any, timeout: float = 120.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        async def stop() -> None:
            await self.http.stop()
            if self.gateway.training is not None:
                self.stop_event.set()
                await self.gateway.training.close()
                await self.bus.close()
            await self.gateway.pool.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeReplica:
    """A Replica that streams made-up tokens: completion i of a prompt is the letters of
    `WORD` shifted by i, one token per delta, each with logprob -0.5 - 0.1 * position."""

    WORD = "abcdefghijklmnopqrstuvwxyz"
    MAX_CONTEXT = 64

    def __init__(self, address: str = "fake:1", *, model: str = "fake-model") -> None:
        self.address = address
        self.model = model
        self.serving = True
        self.fail_before: Callable[[], RlfleetError] | None = None  # raised before any message
        self.fail_after_tokens: int | None = None  # Unavailable after this many deltas
        self.delay_s = 0.0  # between deltas
        self.requests: list[sampler_pb2.GenerateStreamRequest] = []
        self.open_streams = 0
        self.cancelled = 0

    async def info(self) -> sampler_pb2.GetInfoResponse:
        if not self.serving:
            raise Unavailable(f"sampler {self.address}: down")
        return sampler_pb2.GetInfoResponse(
            model_name=self.model,
            model_path="/models/fake",
            max_context_length=self.MAX_CONTEXT,
            max_n=8,
        )

    async def healthy(self, timeout_s: float) -> bool:
        return self.serving

    async def close(self) -> None:
        pass

    def stream(
        self, request: sampler_pb2.GenerateStreamRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]:
        self.requests.append(request)
        return self._stream(request)

    def prompt_ids(self, prompt: sampler_pb2.Prompt) -> list[int]:
        kind = prompt.WhichOneof("input")
        if kind == "text":
            return [ord(c) % 97 for c in prompt.text]
        if kind == "token_ids":
            return tensor.decode(prompt.token_ids).tolist()
        text = "".join(f"<{m.role}>{m.content}" for m in prompt.chat.messages)
        return [ord(c) % 97 for c in text]

    def tool_call_deltas(
        self, request: sampler_pb2.GenerateStreamRequest
    ) -> list[sampler_pb2.CompletionDelta]:
        """Each completion: "Sure. ", then a call of the first tool with {"a": 1} in two
        argument pieces (index 0), then a call of the last tool with {} (index 1)."""
        tools = [t["function"]["name"] for t in request.prompt.chat.tools]
        out = []
        for i in range(max(1, request.sampling.n)):
            ToolDelta = sampler_pb2.ToolCallDelta
            out += [
                sampler_pb2.CompletionDelta(index=i, text="Sure. "),
                sampler_pb2.CompletionDelta(
                    index=i, tool_calls=[ToolDelta(index=0, id=f"call_{i}a", name=tools[0])]
                ),
                sampler_pb2.CompletionDelta(
                    index=i, tool_calls=[ToolDelta(index=0, arguments='{"a": ')]
                ),
                sampler_pb2.CompletionDelta(
                    index=i,
                    tool_calls=[
                        ToolDelta(index=0, arguments="1}"),
                        ToolDelta(index=1, id=f"call_{i}b", name=tools[-1], arguments="{}"),
                    ],
                ),
                sampler_pb2.CompletionDelta(index=i, finish_reason=sampler_pb2.FINISH_REASON_STOP),
            ]
        return out

    async def _stream(
        self, request: sampler_pb2.GenerateStreamRequest
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]:
        if not self.serving:
            raise Unavailable(f"sampler {self.address}: GenerateStream: connection refused")
        if self.fail_before is not None:
            raise self.fail_before()
        s = request.sampling
        if s.n > 8:
            raise InvalidArgument("sampling.n must be in [1, 8]", field="sampling.n")
        ids = self.prompt_ids(request.prompt)
        prompt_kind = request.prompt.WhichOneof("input")
        if len(ids) >= self.MAX_CONTEXT:
            field = f"prompt.{prompt_kind}"  # as sampler/lm/requests.py words it
            raise InvalidArgument(
                f"sampler {self.address}: GenerateStream: {field}: the prompt has {len(ids)} "
                f"tokens, leaving no room to generate in the context of {self.MAX_CONTEXT} tokens",
                field=field,
            )
        self.open_streams += 1
        finished = False
        try:
            yield sampler_pb2.GenerateStreamResponse(
                start=sampler_pb2.StreamStart(
                    prompt_token_ids=tensor.encode(np.asarray(ids, np.int32))
                )
            )
            if request.prompt.chat.tools:  # as a sampler reads a model that calls a tool
                for delta in self.tool_call_deltas(request):
                    yield sampler_pb2.GenerateStreamResponse(delta=delta)
                finished = True
                return
            room = self.MAX_CONTEXT - len(ids)
            length = min(s.max_tokens or room, room)
            n = max(1, s.n)
            sent = 0
            texts = [[self.WORD[(t + i) % 26] for t in range(length)] for i in range(n)]
            done: set[int] = set()
            for t in range(length):
                for i in range(n):
                    if i in done:
                        continue
                    if self.fail_after_tokens is not None and sent >= self.fail_after_tokens:
                        # What grpc reports for a broken connection, peer address included.
                        raise Unavailable(
                            f"sampler {self.address}: GenerateStream: Socket closed "
                            f"(ipv4:127.0.0.1:41234: UNAVAILABLE)"
                        )
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    token = texts[i][t]
                    so_far = "".join(texts[i][: t + 1])
                    stop = next((x for x in s.stop if so_far.endswith(x)), None)
                    last = t == length - 1 or stop is not None
                    delta = sampler_pb2.CompletionDelta(
                        index=i,
                        token_ids=tensor.encode(np.asarray([ord(token)], np.int32)),
                        text="" if stop else token,
                        finish_reason=(
                            sampler_pb2.FINISH_REASON_STOP
                            if stop
                            else sampler_pb2.FINISH_REASON_LENGTH
                            if last
                            else 0
                        ),
                    )
                    if s.logprobs:
                        delta.logprobs.CopyFrom(
                            tensor.encode(np.asarray([-0.5 - 0.1 * t], np.float32))
                        )
                        delta.token_texts.append(token)
                        k = s.top_logprobs
                        if k:
                            delta.top_token_ids.CopyFrom(
                                tensor.encode(np.arange(k, dtype=np.int32).reshape(1, k))
                            )
                            delta.top_logprobs.CopyFrom(
                                tensor.encode(-np.arange(1, k + 1, dtype=np.float32).reshape(1, k))
                            )
                            delta.top_token_texts.extend(self.WORD[j] for j in range(k))
                    sent += 1
                    yield sampler_pb2.GenerateStreamResponse(delta=delta)
                    if last:
                        done.add(i)
                if len(done) == n:
                    break
            finished = True
        finally:
            self.open_streams -= 1
            if not finished:
                self.cancelled += 1

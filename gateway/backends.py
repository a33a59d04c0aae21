"""Serving samplers behind the gateway: one ``Backend`` per replica, a ``BackendPool`` that
balances, health-checks and fails over.

The engine interface is ``Replica``: what the serving classes need from one sampler (a stream
of GenerateStreamResponse per request, GetInfo, a health probe). ``SamplerReplica`` implements
it over ``clients.sampler.SamplerClient`` (the sampler's client module, the only way in) plus
the standard gRPC health service; tests implement it with a fake.

- Balancing: the healthy backend with the fewest open streams; ties go round-robin.
- Health: a background probe per backend (gRPC health of SamplerService every
  ``interval_s``); a failed or NOT_SERVING probe takes it out of rotation, the next SERVING one
  brings it back (and refreshes GetInfo). A request that meets UNAVAILABLE takes its backend out
  at once, without waiting for the probe.
- Failover: ``open`` reads a stream up to its first delta; UNAVAILABLE (or a connection error),
  RESOURCE_EXHAUSTED or ABORTED before that moves the request to another healthy backend (up to
  ``max_attempts`` backends). After the first delta a failure is the caller's (``BackendLost``):
  a non-streaming request can still be re-run elsewhere, since nothing has been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import metrics
from gateway.errors import ApiError, NoBackend
from rlfleet.sampler.v1 import sampler_pb2
from services import telemetry
from services.errors import RlfleetError, Unavailable, from_rpc_error
from services.membership import PeerView

__all__ = [
    "Backend",
    "BackendLost",
    "BackendPool",
    "OpenedStream",
    "Replica",
    "SamplerReplica",
    "error_code",
]

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.2  # how often the pool compares its backends with the membership

# Codes worth another replica when nothing has been streamed yet.
_FAILOVER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
)


class Replica(Protocol):
    """One serving sampler, as the gateway sees it."""

    address: str

    def stream(
        self, request: sampler_pb2.GenerateStreamRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]: ...

    async def info(self) -> sampler_pb2.GetInfoResponse: ...

    async def healthy(self, timeout_s: float) -> bool: ...

    async def close(self) -> None: ...


class SamplerReplica:
    """``Replica`` over clients.sampler: SamplerClient for GetInfo and GenerateStream, the gRPC
    health service (on a channel of its own) for probes."""

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        from clients.sampler import SERVICE_NAME, SamplerClient
        from services.server import channel

        self.address = address
        self._client = SamplerClient(address, timeout_s=timeout_s)
        self._service = SERVICE_NAME
        self._health_channel = channel(address)
        self._health = health_pb2_grpc.HealthStub(self._health_channel)

    def stream(
        self, request: sampler_pb2.GenerateStreamRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[sampler_pb2.GenerateStreamResponse]:
        return self._client.stream(request, timeout_s=timeout_s)

    async def info(self) -> sampler_pb2.GetInfoResponse:
        return await self._client.info()

    async def healthy(self, timeout_s: float) -> bool:
        try:
            reply = await self._health.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=self._service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._client.close()
        await self._health_channel.close()


def error_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC code of a failed sampler call (connection errors count as UNAVAILABLE)."""
    if isinstance(exc, RlfleetError):
        return exc.code
    if isinstance(exc, grpc.RpcError):
        return from_rpc_error(exc).code
    if isinstance(exc, ConnectionError | OSError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def as_rlfleet(exc: BaseException, address: str) -> RlfleetError:
    if isinstance(exc, RlfleetError):
        return exc
    if isinstance(exc, grpc.RpcError):
        return from_rpc_error(exc)
    if isinstance(exc, ConnectionError | OSError):
        return Unavailable(f"sampler {address}: {type(exc).__name__}: {exc}")
    error = RlfleetError(f"sampler {address}: {type(exc).__name__}: {exc}")
    return error


class BackendLost(Exception):
    """A sampler stream failed after it had started streaming."""

    def __init__(self, backend: Backend, error: RlfleetError) -> None:
        super().__init__(str(error))
        self.backend = backend
        self.error = error

    @property
    def retryable(self) -> bool:
        return self.error.code in _FAILOVER


@dataclass(eq=False)
class Backend:
    """One replica and what the pool knows about it."""

    replica: Replica
    healthy: bool = False
    outstanding: int = 0
    info: sampler_pb2.GetInfoResponse | None = None
    last_error: str | None = None
    checked_at: float = 0.0

    @property
    def address(self) -> str:
        return self.replica.address

    def acquire(self) -> None:
        self.outstanding += 1
        metrics.BACKEND_OUTSTANDING.labels(self.address).set(self.outstanding)
        metrics.BACKEND_REQUESTS.labels(self.address).inc()

    def release(self) -> None:
        self.outstanding -= 1
        metrics.BACKEND_OUTSTANDING.labels(self.address).set(self.outstanding)

    def set_healthy(self, healthy: bool, why: str | None = None) -> None:
        if healthy != self.healthy:
            if healthy:
                log.info("backend %s is healthy: back in rotation", self.address)
            else:
                log.warning("backend %s taken out of rotation: %s", self.address, why)
        self.healthy = healthy
        if not healthy:
            self.last_error = why
        metrics.BACKEND_HEALTHY.labels(self.address).set(1 if healthy else 0)


@dataclass(eq=False)
class OpenedStream:
    """A sampler stream read up to its first delta: ``start`` (the prompt as the engine saw it),
    then the deltas by iteration. ``aclose`` cancels the generation (idempotent)."""

    backend: Backend
    start: sampler_pb2.StreamStart
    _iterator: AsyncIterator[sampler_pb2.GenerateStreamResponse]
    _buffered: list[sampler_pb2.CompletionDelta] = field(default_factory=list)
    _closed: bool = False
    first_delta_at: float = 0.0  # time.monotonic() of the first delta
    started_at: float = 0.0  # time.monotonic() of ``start`` (of the first delta without one)

    @property
    def prompt_tokens(self) -> int:
        shape = self.start.prompt_token_ids.shape
        return int(shape[0]) if shape else 0

    async def __aiter__(self) -> AsyncIterator[sampler_pb2.CompletionDelta]:
        try:
            while self._buffered:
                yield self._buffered.pop(0)
            while True:
                try:
                    message = await anext(self._iterator)
                except StopAsyncIteration:
                    return
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except BaseException as exc:
                    error = as_rlfleet(exc, self.backend.address)
                    metrics.BACKEND_ERRORS.labels(self.backend.address, error.code.name).inc()
                    if error.code == grpc.StatusCode.UNAVAILABLE:
                        self.backend.set_healthy(False, str(error))
                    raise BackendLost(self.backend, error) from exc
                if message.WhichOneof("event") == "delta":
                    yield message.delta
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.release()
        close = getattr(self._iterator, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


class BackendPool:
    """Replicas behind one gateway; see the module docstring for the rules."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 2.0,
        max_attempts: int = 3,
        request_timeout_s: float | None = 600.0,
    ) -> None:
        if not replicas:
            raise ValueError("BackendPool: no replicas")
        self.backends = [Backend(r) for r in replicas]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self._turn = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._watchers: dict[Backend, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        for backend in self.backends:
            metrics.BACKEND_HEALTHY.labels(backend.address).set(0)
            metrics.BACKEND_OUTSTANDING.labels(backend.address).set(0)

    # ------------------------------------------------------------------ health

    async def start(self) -> None:
        """One probe round now, then probes in the background."""
        await asyncio.gather(*(self._probe(b) for b in self.backends))
        for backend in self.backends:
            self._watch_backend(backend)

    def _watch_backend(self, backend: Backend) -> None:
        task = asyncio.create_task(self._watch(backend), name=f"health {backend.address}")
        self._watchers[backend] = task

    def follow(self, peers: PeerView, connect: Callable[[str], Replica]) -> None:
        """Keep the backends in step with ``peers`` from now on: a replica that registers is
        probed and put in rotation, one that leaves is taken out and closed once its streams
        have ended (services/membership.py)."""
        self._tasks.append(asyncio.create_task(self._follow(peers, connect), name="membership"))

    async def _follow(self, peers: PeerView, connect: Callable[[str], Replica]) -> None:
        seen = peers.version
        while True:
            await asyncio.sleep(FOLLOW_POLL_S)
            if peers.version == seen:
                continue
            seen = peers.version
            live = peers.addresses()
            current = {b.address: b for b in self.backends}
            for address in live:
                if address not in current:
                    backend = Backend(connect(address))
                    self.backends.append(backend)
                    log.info("backend %s joined", address)
                    await self._probe(backend)
                    self._watch_backend(backend)
            for address, backend in current.items():
                if address not in live:
                    self.backends.remove(backend)
                    backend.set_healthy(False, "left the run's membership")
                    self._watchers.pop(backend).cancel()
                    self._tasks.append(asyncio.create_task(self._retire(backend)))
            self._changed.set()

    async def _retire(self, backend: Backend) -> None:
        """Close a replica that left once its open streams have ended."""
        while backend.outstanding:
            await asyncio.sleep(FOLLOW_POLL_S)
        await backend.replica.close()

    async def wait_healthy(self, timeout_s: float) -> bool:
        """True once some backend is healthy, False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy_backends():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    async def _watch(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._probe(backend)

    async def _probe(self, backend: Backend) -> None:
        try:
            ok = await backend.replica.healthy(self.health_timeout_s)
            if ok and (backend.info is None or not backend.healthy):
                backend.info = await asyncio.wait_for(
                    backend.replica.info(), self.health_timeout_s * 2
                )
            why = None if ok else "health check: not SERVING"
        except Exception as exc:
            ok, why = False, f"health check: {type(exc).__name__}: {exc}"
        backend.checked_at = time.monotonic()
        was = backend.healthy
        backend.set_healthy(ok, why)
        if ok != was:
            self._changed.set()

    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def info(self) -> sampler_pb2.GetInfoResponse | None:
        """GetInfo of a healthy backend (else of any that answered once)."""
        for backend in [*self.healthy_backends(), *self.backends]:
            if backend.info is not None:
                return backend.info
        return None

    async def close(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(b.replica.close() for b in self.backends), return_exceptions=True)

    # ------------------------------------------------------------------ requests

    def pick(self, exclude: set[Backend] | frozenset[Backend] = frozenset()) -> Backend | None:
        """The healthy backend (not in ``exclude``) with the fewest open streams."""
        candidates = [b for b in self.backends if b.healthy and b not in exclude]
        if not candidates:
            return None
        turn = next(self._turn)
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        return min(rotated, key=lambda b: b.outstanding)

    async def open(
        self, request: sampler_pb2.GenerateStreamRequest, *, exclude: set[Backend] | None = None
    ) -> OpenedStream:
        """A stream started on some healthy backend, read up to its first delta (failover
        before that; see the module docstring). Raises the sampler's error (RlfleetError) when
        it is not worth another replica, NoBackend when none is left to try."""
        tried: set[Backend] = set(exclude or ())
        last: RlfleetError | None = None
        for attempt in range(self.max_attempts):
            backend = self.pick(tried)
            if backend is None:
                break
            tried.add(backend)
            if attempt:
                metrics.FAILOVERS.inc()
            with telemetry.tracer().start_as_current_span(
                "gateway.backend.open",
                attributes={"rlfleet.backend": backend.address, "rlfleet.attempt": attempt},
            ):
                try:
                    return await self._open_on(backend, request)
                except RlfleetError as error:
                    if error.code not in _FAILOVER:
                        raise
                    last = error
                    log.warning("backend %s failed before streaming: %s", backend.address, error)
        if last is not None and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise last
        if last is not None:
            # Each failure was logged above; the client gets no sampler addresses.
            raise NoBackend("no healthy sampler could take the request")
        raise NoBackend()

    async def _open_on(
        self, backend: Backend, request: sampler_pb2.GenerateStreamRequest
    ) -> OpenedStream:
        backend.acquire()
        iterator: Any = None
        try:
            iterator = backend.replica.stream(request, timeout_s=self.request_timeout_s)
            start: sampler_pb2.StreamStart | None = None
            started_at = 0.0
            while True:
                try:
                    message = await anext(iterator)
                except StopAsyncIteration:
                    raise RlfleetError(
                        f"sampler {backend.address}: the stream ended before its first delta"
                    ) from None
                kind = message.WhichOneof("event")
                if kind == "start":
                    start = message.start
                    started_at = time.monotonic()
                elif kind == "delta":
                    opened = OpenedStream(
                        backend, start or sampler_pb2.StreamStart(), iterator, [message.delta]
                    )
                    opened.first_delta_at = time.monotonic()
                    opened.started_at = started_at or opened.first_delta_at
                    return opened
        except (asyncio.CancelledError, GeneratorExit):
            await _close_quietly(iterator)
            backend.release()
            raise
        except ApiError:
            await _close_quietly(iterator)
            backend.release()
            raise
        except BaseException as exc:
            await _close_quietly(iterator)
            backend.release()
            error = as_rlfleet(exc, backend.address)
            metrics.BACKEND_ERRORS.labels(backend.address, error.code.name).inc()
            if error.code == grpc.StatusCode.UNAVAILABLE:
                backend.set_healthy(False, str(error))
            raise error from exc


async def _close_quietly(iterator: Any) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()

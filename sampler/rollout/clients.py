"""The driver's two peers: SamplerService (round-robin over replicas) and RewardService.

Thin adapters over the generated stubs that speak protobuf both ways, because the driver copies
the sampler's Completions and the reward service's FunctionScores into TrajectoryGroups as they
are (reward_service/client.py's RewardClient turns them into dataclasses instead). Failed calls
raise the services.errors class the server raised (`from_rpc_error`); `call_with_retry` decides
what is worth retrying.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.errors import RlfleetError, from_rpc_error
from services.server import channel, wait_for_health

__all__ = [
    "RETRIED",
    "REWARD_SERVICE",
    "SAMPLER_SERVICE",
    "RewardCalls",
    "SamplerCalls",
    "call_with_retry",
    "wait_healthy",
]

log = logging.getLogger(__name__)

SAMPLER_SERVICE = "rlfleet.sampler.v1.SamplerService"
REWARD_SERVICE = "rlfleet.reward.v1.RewardService"
# Transient: the peer is starting, restarting, saturated, or slower than the deadline. Anything
# else (INVALID_ARGUMENT: an unknown reward name; FAILED_PRECONDITION: a game actor as sampler)
# will not get better by asking again.
RETRIED = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
    }
)
T = TypeVar("T")


async def _call(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        error = from_rpc_error(exc)
        error.message = f"{what}: {error.message}"
        error.args = (error.message,)
        raise error from None


class SamplerCalls:
    """Generate on the samplers in turn (one call each), so replicas share the load."""

    def __init__(self, addresses: Sequence[str], timeout_s: float) -> None:
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self._channels = [channel(address) for address in self.addresses]
        self._stubs = [sampler_pb2_grpc.SamplerServiceStub(c) for c in self._channels]
        self._turn = itertools.cycle(range(len(self.addresses)))

    async def generate(
        self, request: sampler_pb2.GenerateRequest
    ) -> tuple[str, sampler_pb2.GenerateResponse]:
        """(address that answered, response) from the next sampler in turn."""
        index = next(self._turn)
        address = self.addresses[index]
        call = self._stubs[index].Generate(request, timeout=self.timeout_s)
        return address, await _call(f"sampler {address}: Generate", call)

    async def info(self, index: int = 0) -> sampler_pb2.GetInfoResponse:
        address = self.addresses[index]
        call = self._stubs[index].GetInfo(sampler_pb2.GetInfoRequest(), timeout=30.0)
        return await _call(f"sampler {address}: GetInfo", call)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)


class RewardCalls:
    """Score on one reward service."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        call = self._stub.Score(request, timeout=self.timeout_s)
        return await _call(f"reward service {self.address}: Score", call)

    async def close(self) -> None:
        await self._channel.close()


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    what: str,
    stop: asyncio.Event,
    *,
    first_delay_s: float = 1.0,
    max_delay_s: float = 30.0,
) -> T | None:
    """``fn()``, retried with exponential backoff while it fails transiently (RETRIED) and
    ``stop`` is not set; None when stopped. Other errors propagate."""
    delay = first_delay_s
    while True:
        try:
            return await fn()
        except RlfleetError as exc:
            if exc.code not in RETRIED:
                raise
            log.warning("%s failed (%s): %s; retrying in %.0fs", what, exc.code.name, exc, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return None
        except TimeoutError:
            delay = min(delay * 2, max_delay_s)


async def wait_healthy(
    what: str, address: str, service: str, stop: asyncio.Event, timeout_s: float
) -> bool:
    """Wait until ``address`` reports SERVING for ``service``, saying so in the log every
    30 s; False when stopped meanwhile, TimeoutError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    said = started - 30.0
    while not stop.is_set():
        left = started + timeout_s - loop.time()
        if left <= 0:
            raise TimeoutError(f"{what} at {address} not healthy after {timeout_s:g}s")
        try:
            # Short rounds: the blocking check runs in a thread, which a stop cannot interrupt.
            await asyncio.to_thread(wait_for_health, address, min(left, 2.0), service)
            return True
        except TimeoutError as exc:
            if loop.time() - said >= 30.0:
                said = loop.time()
                log.info(
                    "waiting for %s at %s to become healthy (%.0fs so far): %s",
                    what,
                    address,
                    said - started,
                    exc,
                )
    return False

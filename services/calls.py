"""Calling another service: errors that say which peer raised them, retries of transient
failures, and waiting for a peer to become healthy.

The service clients (clients/sampler.py, clients/reward.py, ...) run each call through
``rpc``, so a failed call raises the services.errors class the server raised, its message
prefixed with the peer and method ("reward service 10.0.0.3:50051: Score: unknown reward ...").
``call_with_retry`` decides what is worth asking again; ``wait_healthy`` waits at start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from services.errors import RlfleetError, from_rpc_error
from services.server import wait_for_health

__all__ = ["RETRIED", "call_with_retry", "rpc", "wait_healthy"]

log = logging.getLogger(__name__)

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


async def rpc(what: str, call: Awaitable[T]) -> T:
    """Await the gRPC ``call``; a failure raises the services.errors class the server raised
    (``from_rpc_error``, field and details kept) with ``what: `` before its message."""
    try:
        return await call
    except grpc.RpcError as exc:
        error = from_rpc_error(exc)
        error.message = f"{what}: {error.message}"
        error.args = (error.message,)
        raise error from None


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    what: str,
    stop: asyncio.Event,
    *,
    first_delay_s: float = 1.0,
    max_delay_s: float = 30.0,
) -> T | None:
    """``fn()``, retried with exponential backoff while it fails transiently (RETRIED) and
    ``stop`` is not set; None when stopped, also when the call failed once ``stop`` was set
    (a run ending stops every service at once: the callee cancels the calls it is serving,
    which is the shutdown, not a failure to report). Other errors propagate."""
    delay = first_delay_s
    while True:
        try:
            return await fn()
        except RlfleetError as exc:
            if stop.is_set():
                log.info("%s ended by the shutdown (%s): %s", what, exc.code.name, exc)
                return None
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

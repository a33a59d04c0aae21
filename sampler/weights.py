"""Following the learner's weight versions without stalling generation.

Shared by game actors (sampler/actors) and the language-model sampler (sampler/lm). A consumer
needs a version before it starts (`first`), then takes newer ones when it can apply them: an
actor between fragments, so that every fragment has one policy version; the LM sampler as soon
as one arrives (`wait_newer`, then `take`). Fetching (a gRPC stream, checksums) runs in a
background task as soon as a `WeightsPublished` event announces a version. Several
announcements while one fetch runs collapse into fetching the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject
from services.errors import RlfleetError, Unavailable

__all__ = ["WeightFollower"]

log = logging.getLogger(__name__)


async def _fetch(
    address: str, version: int | None, digest: str | None = None
) -> tuple[int, dict[str, Any]]:
    """(version, state dict) of `version` (None: the latest) from the learner's WeightService;
    `digest` is the manifest digest the announcement named (checked by fetch_weights)."""
    from learner.client import fetch_weights

    manifest, tensors = await fetch_weights(address, version, expected_digest=digest or None)
    return int(manifest.version), tensors


class WeightFollower:
    """Fetches each newer announced version in the background; hands it over on request."""

    def __init__(self, bus: Bus, run: str, address: str, *, retry_s: float = 1.0) -> None:
        self.bus = bus
        self.run = run
        self.address = address
        self.retry_s = retry_s
        self.version = -1  # newest version fetched (handed over or pending)
        self._announced = -1
        self._digests: dict[int, str] = {}  # announced version -> manifest digest
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()  # a newer version was fetched
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Subscribe before the first fetch, so no announcement falls between the two."""
        sub = await self.bus.subscribe(
            events_subject(self.run, "weights"), events_pb2.WeightsPublished
        )
        self._tasks = [
            asyncio.create_task(self._watch(sub), name="weights-watch"),
            asyncio.create_task(self._fetcher(), name="weights-fetch"),
        ]

    async def first(
        self, stop: asyncio.Event, timeout_s: float
    ) -> tuple[int, dict[str, Any]] | None:
        """The learner's latest version, retrying while it is not up or has none yet; None
        when told to stop meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                version, state = await _fetch(self.address, None)
                self.version = max(self.version, version)
                return version, state
            except Unavailable as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"learner {self.address}: no weights within {timeout_s:g}s: {exc}"
                    ) from exc
                log.info("waiting for the learner's weights at %s: %s", self.address, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.retry_s)
            if stop.is_set():
                return None

    def take(self) -> tuple[int, dict[str, Any]] | None:
        """The newest fetched version not handed over yet, or None."""
        pending, self._pending = self._pending, None
        return pending

    async def wait_newer(self, version: int, stop: asyncio.Event, timeout_s: float) -> bool:
        """Wait until a version newer than `version` has been fetched (True), or until stopped
        or `timeout_s` passed (False). Bounds how far an actor runs ahead of the learner."""
        deadline = time.monotonic() + timeout_s
        while self.version <= version and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._arrived.clear()
            waiters = [
                asyncio.ensure_future(self._arrived.wait()),
                asyncio.ensure_future(stop.wait()),
            ]
            _, pending = await asyncio.wait(
                waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for waiter in pending:
                waiter.cancel()
        return self.version > version

    async def _watch(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                version = int(delivery.message.version)
                if version > max(self._announced, self.version):
                    self._announced = version
                    self._digests = {version: delivery.message.manifest_digest}
                    self._wake.set()

    async def _fetcher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            wanted = self._announced
            if wanted <= self.version:
                continue
            try:
                version, state = await _fetch(self.address, wanted, self._digests.get(wanted))
            except RlfleetError as exc:
                log.warning("fetching weights v%d from %s failed: %s", wanted, self.address, exc)
                if isinstance(exc, Unavailable):  # else (no longer kept): wait for a newer one
                    await asyncio.sleep(self.retry_s)
                    if self._announced == wanted:
                        self._wake.set()  # again, unless something newer came meanwhile
                continue
            if version > self.version:
                self.version = version
                self._pending = (version, state)
                self._arrived.set()
                log.info("fetched weights v%d from %s", version, self.address)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""How far a rollout driver may run ahead of the learner.

The driver only follows the learner's version numbers (WeightsPublished events on
``rlfleet.v1.events.<run>.weights``); the sampler fetches and loads the weights itself.

The rule (credit-based, like the game actors' `_pace`): the learner turns `groups_per_version`
groups of this driver into one version, so counting from the version `base` in force when the
driver started, its k-th group (from 0) is trained by the learner at version
`base + k // groups_per_version`. A group sampled with version v is then
`base + k // groups_per_version - v` versions old when trained; keeping that within
`max_policy_lag` means: start group k only once the learner has announced version
`base + k // groups_per_version - max_policy_lag`. With lag 0 the driver waits while the
learner trains (strictly on-policy); with lag 1 it samples the next batch meanwhile, so it is
never more than `max_policy_lag + 1` versions' worth of groups ahead. The check uses announced
versions; the sampler loads them shortly after, and a group generated in between would come out
one version older and be dropped as stale by the learner (leaving this driver's count ahead of
what the learner needs: a stall until `version_wait_s`). So after the announcement the driver
also waits until every sampler reports the version (`loaded_version`, GetInfo).

If the version needed does not come within `version_wait_s` (the learner restarted, drivers
joined or left, so this driver's share of a batch changed), counting restarts from the newest
version: waiting longer would only stall the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject

__all__ = ["Pacer", "VersionWatch"]

log = logging.getLogger(__name__)


class VersionWatch:
    """The newest weight version announced (or seen in samples); wakes waiters when it grows."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def start(self, bus: Bus, run: str) -> None:
        sub = await bus.subscribe(events_subject(run, "weights"), events_pb2.WeightsPublished)
        self._task = asyncio.create_task(self._watch(sub), name="weights-watch")

    async def _watch(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                await self.observe(int(delivery.message.version))

    async def observe(self, version: int) -> None:
        """Note a version (announced, or reported by the sampler)."""
        if version > self.version:
            self.version = version
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, version: int, stop: asyncio.Event, timeout_s: float) -> bool:
        """True once ``version`` (or newer) is known; False on timeout or stop."""
        deadline = time.monotonic() + timeout_s
        while self.version < version and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            stopped = asyncio.ensure_future(stop.wait())
            changed = asyncio.ensure_future(self._wait_changed())
            try:
                await asyncio.wait(
                    {stopped, changed}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                stopped.cancel()
                changed.cancel()
        return self.version >= version

    async def _wait_changed(self) -> None:
        async with self._changed:
            await self._changed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Pacer:
    """Credits for starting groups (see the module docstring); None groups_per_version: none."""

    def __init__(
        self,
        watch: VersionWatch,
        groups_per_version: int | None,
        max_policy_lag: int,
        version_wait_s: float,
    ) -> None:
        self.watch = watch
        self.groups_per_version = groups_per_version
        self.max_policy_lag = max_policy_lag
        self.version_wait_s = version_wait_s
        self.base: int | None = None  # set by the first wait, from the version then in force
        self.started = 0  # groups started since `base`
        # The lowest version the samplers serve (GetInfo); None: do not wait for samplers.
        self.loaded_version: Callable[[], Awaitable[int]] | None = None

    def needed(self) -> int:
        """The version that must be announced before the next group starts."""
        assert self.base is not None and self.groups_per_version
        return self.base + self.started // self.groups_per_version - self.max_policy_lag

    async def wait_turn(self, stop: asyncio.Event) -> bool:
        """Wait until the next group may start; False when stopped meanwhile."""
        if not self.groups_per_version:
            return not stop.is_set()
        if self.base is None:
            self.base = self.watch.version
        wanted = self.needed()
        waited = time.monotonic()
        if self.watch.version >= wanted or await self.watch.wait_for(
            wanted, stop, self.version_wait_s
        ):
            await self._samplers_at(wanted, stop, waited + self.version_wait_s)
            return not stop.is_set()
        if stop.is_set():
            return False
        log.warning(
            "no weights v%d after %.0fs: pacing restarts from v%d",
            wanted,
            time.monotonic() - waited,
            self.watch.version,
        )
        self.base, self.started = self.watch.version, 0
        return True

    async def _samplers_at(self, version: int, stop: asyncio.Event, deadline: float) -> None:
        """Until the samplers serve ``version`` (or the deadline passes: pacing then goes on)."""
        if self.loaded_version is None:
            return
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                if await self.loaded_version() >= version:
                    return
            except Exception as exc:  # a sampler restarting: keep pacing on announcements
                log.debug("sampler version unknown: %s", exc)
                return
            await asyncio.sleep(0.02)

    def count(self, groups: int) -> None:
        """``groups`` more groups started."""
        self.started += groups

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
never more than `max_policy_lag + 1` versions' worth of groups ahead. A call's groups all start
on one turn, so a call never reaches past the next version boundary (`room`). The check uses
announced versions; the sampler loads them shortly after, and a group generated in between would
come out one version older and be dropped as stale by the learner (leaving this driver's count
ahead of what the learner needs: a stall until `version_wait_s`). So after the announcement the
driver also waits until every sampler reports the version (`loaded_version`, GetInfo).

Credit back: a group the learner drops without training on it (filtered out by DAPO's dynamic
sampling or the overlong filter, or invalid) still counted as started, yet the learner needs
another group in its place; with enough of them every driver would wait for a version the learner
cannot reach. So the learner announces such drops (GroupsDropped on
``rlfleet.v1.events.<run>.dropped``, naming the producing driver and the group ids) and the pacer
takes each group it counted itself, once, off `started` (`credit`); prompts the driver drops
itself (refused by the sampler, a group too large to publish) are credited at once. Stale drops
are not credited: pacing already keeps groups fresh, so a stale group means the learner moved on
faster than this driver's count assumed (its next turns are free anyway), and credit would let it
run further ahead of `max_policy_lag`.

If the version needed does not come within `version_wait_s` (the learner restarted, drivers
joined or left, so this driver's share of a batch changed, or a credit event was lost: core NATS
is at-most-once), counting restarts from the newest version: waiting longer would only stall the
run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject
from services.errors import InvalidArgument

__all__ = ["DROPPED_EVENTS", "Pacer", "VersionWatch"]

log = logging.getLogger(__name__)

DROPPED_EVENTS = "dropped"  # event kind of GroupsDropped (published by the LM learner)
# Ids of counted groups remembered for credit: far more than are ever in flight (older ones,
# almost all trained long ago, are forgotten first).
TRACKED_GROUPS = 65536


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
        self.started = 0  # groups started since `base`, less the credited ones
        self.credited = 0  # groups credited back, in all (a metric)
        # The lowest version the samplers serve (GetInfo); None: do not wait for samplers.
        self.loaded_version: Callable[[], Awaitable[int]] | None = None
        self._counted: OrderedDict[str, None] = OrderedDict()  # ids not credited yet
        self._credit = asyncio.Event()  # set by `credit`: a waiting turn looks again
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def following(
        cls, knobs: Any, loaded_version: Callable[[], Awaitable[int]] | None = None
    ) -> Pacer:
        """A pacer over a new VersionWatch with the pacing knobs every producer of groups has
        (``groups_per_version``, ``max_policy_lag``, ``version_wait_s``)."""
        pacer = cls(
            VersionWatch(), knobs.groups_per_version, knobs.max_policy_lag, knobs.version_wait_s
        )
        pacer.loaded_version = loaded_version
        return pacer

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
        waited = time.monotonic()
        deadline = waited + self.version_wait_s
        while not stop.is_set():
            self._credit.clear()
            wanted = self.needed()  # a credit lowers it
            if self.watch.version >= wanted:
                await self._samplers_at(wanted, stop, deadline)
                return not stop.is_set()
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "no weights v%d after %.0fs: pacing restarts from v%d",
                    wanted,
                    time.monotonic() - waited,
                    self.watch.version,
                )
                self.base, self.started = self.watch.version, 0
                self._counted.clear()  # credit for those groups would now be extra
                return True
            await self._changed(wanted, stop, left)
        return False

    async def _changed(self, wanted: int, stop: asyncio.Event, timeout_s: float) -> None:
        """Until ``wanted`` is announced, a credit comes, ``stop`` is set or the timeout."""
        waits = [
            asyncio.ensure_future(self.watch.wait_for(wanted, stop, timeout_s)),
            asyncio.ensure_future(self._credit.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

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

    def room(self, wanted: int) -> int:
        """How many of ``wanted`` groups may start on this turn: at most up to the next version
        boundary. Every group of one call starts together, after one turn; a call that crossed
        a boundary (after a credit, or a short batch, left the count between boundaries) would
        start its later groups a version early, and they would come out too stale to train."""
        if not self.groups_per_version:
            return wanted
        return min(wanted, self.groups_per_version - self.started % self.groups_per_version)

    def count(self, groups: int, ids: Iterable[str] = ()) -> None:
        """``groups`` more groups started; ``ids``: their group ids, for credit later."""
        self.started += groups
        for group_id in ids:
            self._counted[group_id] = None
            self._counted.move_to_end(group_id)
        while len(self._counted) > TRACKED_GROUPS:
            self._counted.popitem(last=False)

    def credit(self, ids: Iterable[str]) -> int:
        """Groups counted here that will never be trained (dropped): each gives its start back,
        once; ids this pacer did not count (another incarnation's) are ignored. Returns how
        many were credited."""
        credited = 0
        for group_id in ids:
            if group_id in self._counted:
                del self._counted[group_id]
                credited += 1
        if credited:
            self.started = max(0, self.started - credited)
            self.credited += credited
            self._credit.set()
        return credited

    async def follow_drops(self, bus: Bus, run: str, producer: str) -> None:
        """Take credit from the learner's GroupsDropped events for ``producer``'s groups."""
        sub = await bus.subscribe(events_subject(run, DROPPED_EVENTS), events_pb2.GroupsDropped)
        self._task = asyncio.create_task(self._follow(sub, producer), name="drops-watch")

    async def _follow(self, sub: Any, producer: str) -> None:
        async with sub:
            while True:
                try:
                    delivery = await sub.__anext__()
                except StopAsyncIteration:
                    return
                except InvalidArgument as exc:  # not a GroupsDropped: someone else's bug
                    log.warning("ignoring a message on the dropped-groups subject: %s", exc)
                    continue
                event = delivery.message
                if event.producer != producer:
                    continue
                credited = self.credit(event.group_ids)
                if credited:
                    log.debug(
                        "credit for %d groups dropped by %s (%s)",
                        credited,
                        event.source,
                        event.reason,
                    )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

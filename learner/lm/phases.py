"""A language-model learner's start-up phases on `rlfleet up`'s console, from any thread.

Loading the model, the SFT warm start, the reference scoring of DPO and the wait for the first
rollout take from seconds to minutes before the first update's progress line. The learner says
what it is doing as RunStatus messages (services.bus.announce: the console prints
``<service>: <message>``) and counts long phases in progress records (``sft step 40/120``).
Services never print to the console themselves.

Blocking phases run in worker threads (``asyncio.to_thread``) while the event loop owns the bus:
``Announcer`` hands each event to the loop and, from a worker thread, waits until it is out, so
events reach the console in the order they happened. Best effort: a lost event never fails the
service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, announce, events_subject
from services.errors import RlfleetError
from services.progress import PROGRESS_EVENTS, progress_record
from services.registry import ServiceContext

__all__ = ["Announcer"]

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 10.0  # a worker thread never waits longer for one event to go out


class Announcer:
    """Publishes a service's phases; ``open`` (on the event loop) connects its own bus client,
    ``close`` sends what is pending and disconnects. Without a NATS url it only logs."""

    def __init__(self, ctx: ServiceContext[Any], bus: Bus | None = None) -> None:
        self.ctx = ctx
        self.bus = bus
        self._own_bus = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Future[None]] = set()

    async def open(self) -> Announcer:
        self.loop = asyncio.get_running_loop()
        if self.bus is None and self.ctx.nats_url:
            self.bus = await Bus.connect(self.ctx.nats_url, name=f"{self.ctx.name}-phases")
            self._own_bus = True
        return self

    async def close(self) -> None:
        await asyncio.gather(*self._pending, return_exceptions=True)
        if self._own_bus and self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        self.bus = None

    # --- what a service says ---------------------------------------------------------------

    def say(
        self,
        message: str,
        *,
        running: bool = False,
        state: events_pb2.RunState | None = None,
    ) -> None:
        """A phase (``running``: training is under way, e.g. a resume; ``state``: another
        RunState, e.g. DONE with the summary), from any thread."""
        log.info("%s", message)
        if state is None:
            state = events_pb2.RUN_STATE_RUNNING if running else events_pb2.RUN_STATE_STARTING
        ctx = self.ctx
        self._submit(announce(self.bus, ctx.run_name, ctx.name, message, state))

    def count(
        self, unit: str, done: int, total: int, headline: Iterable[tuple[str, float]] = ()
    ) -> None:
        """A progress record of a phase with steps (``sft step 40/120``), from any thread."""
        record = progress_record(
            self.ctx.name, unit=unit, done=done, total=total, version=None, headline=headline
        )
        self._submit(self._publish(PROGRESS_EVENTS, record))

    def publish(self, kind: str, message: Any) -> None:
        """Any event of the run (``metrics``, ...), from any thread."""
        self._submit(self._publish(kind, message))

    async def _publish(self, kind: str, message: Any) -> None:
        if self.bus is not None:
            with contextlib.suppress(RlfleetError):
                await self.bus.publish_event(events_subject(self.ctx.run_name, kind), message)

    def _submit(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """On the event loop's thread: scheduled (awaited by ``close``); on another thread:
        handed to the loop and waited for."""
        if self.loop is None or self.bus is None:
            coroutine.close()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            task = self.loop.create_task(coroutine)
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            future.result(PUBLISH_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RlfleetError) as exc:
            log.warning("event not published: %s", exc)

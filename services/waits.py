"""Long waits that say what they wait for.

A service that waits on something outside itself (the learner for fragments, an actor for its
first weights, an env server for its first game) wraps the wait in `waiting`: while it lasts,
every ``every_s`` it logs ``waiting for <what> (<n> s)`` and hands the same line to ``say``,
usually `bus_say`, which announces it on the run's bus so that `rlfleet up`'s console prints
it (services never print to the console themselves: services/bus/runs.py)::

    say = bus_say(bus, ctx.run_name, ctx.name)
    first = await waiting("the first weights from learner", follower.first(...), say=say)

A quiet wait is indistinguishable from a hang; one line every few seconds says which it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, announce

__all__ = ["WAIT_NOTICE_S", "Say", "bus_say", "waiting"]

log = logging.getLogger("rlfleet.waits")

T = TypeVar("T")
Say = Callable[[str], Awaitable[None]]

WAIT_NOTICE_S = 15.0  # a wait still going on says so this often


def bus_say(bus: Bus | None, run: str, source: str) -> Say:
    """``say`` for `waiting`: the line as ``source``'s RunStatus (the console prints it as
    ``<source>: <line>``); best effort, nothing without a bus."""

    async def say(line: str) -> None:
        await announce(bus, run, source, line, events_pb2.RUN_STATE_RUNNING)

    return say


async def waiting(
    what: str | Callable[[], str],
    step: Awaitable[T],
    *,
    say: Say | None = None,
    every_s: float = WAIT_NOTICE_S,
    logger: logging.Logger = log,
) -> T:
    """``step``'s result; while it runs, every ``every_s`` one line ``waiting for <what> (<n> s)``
    in ``logger`` and to ``say``. ``what`` may be a callable, read at each line (counts that
    change meanwhile). Cancelling this cancels ``step``."""
    started = time.monotonic()
    task = asyncio.ensure_future(step)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if task.done():
                break
            described = what() if callable(what) else what
            line = f"waiting for {described} ({time.monotonic() - started:.0f} s)"
            logger.info("%s", line)
            if say is not None:
                try:
                    await say(line)
                except Exception as exc:  # a notice must never fail the wait it describes
                    logger.debug("wait notice not sent: %s", exc)
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done

"""A run's status on the bus, as every long-running worker of the run follows it.

Whoever ends a run (the learner, at its last update) publishes ``bus.v1.RunStatus`` on
``rlfleet.v1.events.<run>.status``; a game actor or rollout driver stops when the run is over
(DONE or FAILED) rather than wait for its own SIGTERM::

    watch = await stop_when_run_over(bus, run, ctx.stop_event)  # subscribed from here on
    ...
    watch.cancel()  # at shutdown, if the run was not over

A service's start-up phases (loading a model, SFT, an engine starting) and a resume go out the
same way, as a RunStatus with a message (``announce``), which `rlfleet up`'s console prints as
``<source>: <message>`` (launch/console.py): services never print to the console themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from google.protobuf import timestamp_pb2

from rlfleet.bus.v1 import events_pb2
from services.bus.client import Bus
from services.bus.messages import Subscription
from services.bus.subjects import events_subject
from services.errors import RlfleetError

__all__ = ["RUN_OVER", "announce", "stop_when_run_over"]

log = logging.getLogger("rlfleet.bus")

RUN_OVER = frozenset({events_pb2.RUN_STATE_DONE, events_pb2.RUN_STATE_FAILED})


async def announce(
    bus: Bus | None,
    run: str,
    source: str,
    message: str,
    state: events_pb2.RunState = events_pb2.RUN_STATE_STARTING,
) -> None:
    """Publish ``message`` as ``source``'s RunStatus (default: still starting). Best effort: a
    notice for the console must never fail the service (no bus: nothing)."""
    if bus is None:
        return
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    status = events_pb2.RunStatus(run=run, state=state, message=message, source=source, time=stamp)
    with contextlib.suppress(RlfleetError):
        await bus.publish_event(events_subject(run, "status"), status)


async def stop_when_run_over(bus: Bus, run: str, stop: asyncio.Event) -> asyncio.Task[None]:
    """Subscribe to ``run``'s status events and return the task that sets ``stop`` at the
    first RunStatus saying the run is over (the task then ends). The subscription is live
    when this returns; cancelling the task ends it. A status that fails to decode fails the
    task (its exception), which callers treat like any failed helper task."""
    sub = await bus.subscribe(events_subject(run, "status"), events_pb2.RunStatus)
    return asyncio.create_task(_watch(sub, stop), name=f"run-status-{run}")


async def _watch(sub: Subscription[events_pb2.RunStatus], stop: asyncio.Event) -> None:
    async with sub:
        async for delivery in sub:
            if delivery.message.state in RUN_OVER:
                state = events_pb2.RunState.Name(delivery.message.state)
                log.info("run is over (%s): stopping", state)
                stop.set()
                return

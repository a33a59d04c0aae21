"""Built-in service kinds that exercise the runtime itself.

``heartbeat`` is a real service with no domain logic: a gRPC server answering health checks
that publishes a metrics event every ``interval_s``. It lets the launcher, the CLI and a
deployment be checked end to end (start, health, monitor, restart, stop) without any RL code,
and its ``fail_after_s`` / ``exit_after_s`` settings produce crashes and clean exits on demand
(``preload_s`` / ``preload_fails``: a slow or failing start-up import).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from google.protobuf import struct_pb2
from pydantic import Field

from services.bus import Bus, events_subject
from services.config import ServiceRef, StrictModel
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer

__all__ = ["SPEC", "HeartbeatSettings"]

log = logging.getLogger(__name__)


class HeartbeatSettings(StrictModel):
    """Settings of the ``heartbeat`` kind."""

    interval_s: float = Field(default=1.0, gt=0)  # seconds between heartbeat events
    fail_after_s: float | None = Field(default=None, gt=0)  # crash (exit 1) after this long
    exit_after_s: float | None = Field(default=None, gt=0)  # finish (exit 0) after this long
    healthy_after_s: float = Field(default=0.0, ge=0)  # report SERVING only after this long
    # Its preload (services/start_gate.py) takes this long, like a slow import, or fails, like an
    # import that cannot be made: the launcher's warm start, checked end to end.
    preload_s: float = Field(default=0.0, ge=0)
    preload_fails: bool = False
    # Last beats (``final: true``) sent as it stops, as a rollout driver sends its last metrics
    # (many of them: a burst the launcher must read to the end as the run stops).
    final_beats: int = Field(default=0, ge=0)
    # Other services (instance names or host:port) whose resolved addresses each beat reports:
    # shows that name references in settings reach the right endpoint.
    peers: list[ServiceRef] = []


async def _publish_loop(
    ctx: ServiceContext[HeartbeatSettings], nats_url: str, started: float
) -> None:
    """Publish one Struct heartbeat per interval until cancelled."""
    settings = ctx.settings
    subject = events_subject(ctx.run_name, "metrics")
    peers = ",".join(f"{p}@{ctx.resolve(p)}" for p in settings.peers)
    bus = await Bus.connect(nats_url, name=ctx.name)

    def beat(seq: int) -> struct_pb2.Struct:
        message = struct_pb2.Struct()
        uptime_s = round(time.monotonic() - started, 2)
        message.update({"service": ctx.name, "seq": seq, "uptime_s": uptime_s})
        if peers:
            message["peers"] = peers
        return message

    seq = 0
    try:
        while True:
            seq += 1
            await bus.publish_event(subject, beat(seq))
            await asyncio.sleep(settings.interval_s)
    finally:
        with contextlib.suppress(Exception):
            for k in range(1, settings.final_beats + 1):
                last = beat(seq + k)
                last["final"] = True
                await bus.publish_event(subject, last)
        await bus.close()


async def main(ctx: ServiceContext[HeartbeatSettings]) -> None:
    """Serve health, beat until stopped; crash or finish on schedule when asked to."""
    settings = ctx.settings
    started = time.monotonic()
    server = GrpcServer(ctx.name, host=ctx.host, port=ctx.port)
    port = await server.start()
    if settings.healthy_after_s:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctx.stop_event.wait(), settings.healthy_after_s)
    server.set_serving()
    log.info("heartbeat %s serving on %s:%d", ctx.name, ctx.host, port)
    beats = asyncio.create_task(_publish_loop(ctx, ctx.nats_url, started)) if ctx.nats_url else None
    deadline = min(
        (s for s in (settings.fail_after_s, settings.exit_after_s) if s is not None), default=None
    )
    # Wait for a stop signal or the scheduled end, but notice at once if publishing fails.
    stopped = asyncio.create_task(ctx.stop_event.wait())
    try:
        waiting = {stopped} if beats is None else {stopped, beats}
        done, _ = await asyncio.wait(waiting, timeout=deadline, return_when="FIRST_COMPLETED")
        if beats in done:
            beats.result()  # re-raises why the heartbeat stopped
    finally:
        tasks = [t for t in (stopped, beats) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop()
    if not done and deadline == settings.fail_after_s:
        raise RuntimeError(f"heartbeat {ctx.name}: failing on purpose after {deadline}s")


def preload(settings: HeartbeatSettings) -> None:
    """What `preload_s` and `preload_fails` ask for."""
    time.sleep(settings.preload_s)
    if settings.preload_fails:
        raise ImportError("heartbeat: its preload fails on purpose (preload_fails)")


SPEC = ServiceSpec(
    kind="heartbeat", settings=HeartbeatSettings, main=main, grpc=True, preload=preload
)

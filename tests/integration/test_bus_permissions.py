"""Per-kind NATS permissions (services/bus/subjects.py `service_permissions`) on a real
nats-server with users, as `rlfleet up` configures it under `security: {nats_auth: true}`.

Each kind does what it does in a run (the launcher creates the streams first), and an actor's
password cannot shrink the run's stream, delete the learner's consumer, create a stream on
another run's subjects or publish there, nor read the learner's replies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from google.protobuf.struct_pb2 import Struct

from launch.run_security import LAUNCHER, RunSecurity
from services.bus import Bus, EmbeddedNats, NatsUser, events_subject, service_permissions
from services.bus.subjects import (
    QUEUE_DURABLE,
    stream_name,
    traj_subject,
    work_queue_stream,
    work_queue_subject,
)
from services.security import NatsCredentials

pytestmark = pytest.mark.timeout(120)

RUN, OTHER, QUEUE = "perm-a", "perm-b", "prompts"
KINDS = {"learner": "learner", "actor-0": "game_actor", "driver-0": "rollout", "llm": "sampler"}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    users = [NatsUser(LAUNCHER, "adm")]
    users += [
        NatsUser(name, "pw-" + name, **service_permissions(RUN, kind, name, queues=(QUEUE,)))
        for name, kind in KINDS.items()
    ]
    nats_server = EmbeddedNats(tmp_path / "nats", users=users)
    await nats_server.start_async()
    try:
        yield nats_server
    finally:
        nats_server.stop()


@contextlib.asynccontextmanager
async def connect(
    server: EmbeddedNats, user: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Bus]:
    password = "adm" if user == LAUNCHER else "pw-" + user
    for key, value in NatsCredentials(user, password).env().items():
        monkeypatch.setenv(key, value)
    # A refused request is never answered: a short timeout keeps the refusals quick.
    async with Bus.connect(server.url, name=user, request_timeout_s=1.0) as bus:
        yield bus


async def refused(bus: Bus, call: Any) -> None:
    """``call`` fails and the server says why: a permissions violation."""
    with pytest.raises(Exception):  # noqa: B017 - nats-py times out a refused request
        await call
    await asyncio.sleep(0.2)
    assert "permissions violation" in str(bus.nc.last_error).lower()


async def make_run(server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the launcher does before any service starts, for this run and another one."""
    security = RunSecurity(RUN, queues=(QUEUE,))
    security.nats = {LAUNCHER: NatsCredentials(LAUNCHER, "adm")}
    async with connect(server, LAUNCHER, monkeypatch):
        await security.create_streams(server.url)
        other = RunSecurity(OTHER)
        other.nats = security.nats
        await other.create_streams(server.url)


def big(i: int) -> Struct:
    message = Struct()
    message.update({"blob": "x" * 1_500_000, "i": i})  # over the max payload: by reference
    return message


async def test_each_kind_does_its_part_of_a_run(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_run(server, monkeypatch)
    stream, traj = stream_name(RUN), traj_subject(RUN)
    async with connect(server, "learner", monkeypatch) as learner:
        await learner.ensure_stream(stream, [traj])
        status = await learner.subscribe(events_subject(RUN, "episodes"), Struct)
        pulled: Any = learner.pull(stream, "learner", traj, Struct, timeout_s=0.3)
        async with connect(server, "actor-0", monkeypatch) as actor:
            await actor.ensure_stream(stream, [traj])  # exists: only looked up
            await actor.publish_with_retry(traj, Struct(), msg_id="small")
            await actor.publish_with_retry(traj, big(1), msg_id="big")
            await actor.publish_event(events_subject(RUN, "episodes"), Struct())
            await actor.nc.flush()
            assert actor.nc.last_error is None
        got = [await anext(pulled), await anext(pulled)]
        assert got[1].message == big(1)
        for delivery in got:
            await delivery.ack()  # the big one's payload is deleted too
        await pulled.aclose()
        event = await asyncio.wait_for(anext(aiter(status)), 5)
        assert event.subject == events_subject(RUN, "episodes")
        await status.aclose()
        assert learner.nc.last_error is None

    wq, work = work_queue_stream(RUN, QUEUE), work_queue_subject(RUN, QUEUE)
    async with connect(server, "driver-0", monkeypatch) as driver:
        await driver.ensure_stream(wq, [work], retention="workqueue")
        cursor = await driver.kv(f"{wq}-FEED")
        await cursor.put("cursor", b"{}")
        assert (await cursor.get("cursor")).value == b"{}"
        await driver.publish(work, Struct(), msg_id="task-1")
        assert (await driver.js.stream_info(wq)).state.messages == 1
        tasks: Any = driver.pull(wq, QUEUE_DURABLE, work, Struct, timeout_s=0.3)
        await (await anext(tasks)).ack()
        await tasks.aclose()
        await driver.publish_with_retry(traj, big(2), msg_id="group")
        await driver.publish_event(events_subject(RUN, "metrics"), Struct())
        await driver.nc.flush()
        assert driver.nc.last_error is None
    async with connect(server, "llm", monkeypatch) as sampler:
        await sampler.publish_event(events_subject(RUN, "status"), Struct())
        await sampler.nc.flush()
        assert sampler.nc.last_error is None


async def test_an_actors_password_cannot_change_the_run_or_reach_another_run(
    server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nats.js import api

    await make_run(server, monkeypatch)
    stream, traj = stream_name(RUN), traj_subject(RUN)
    async with connect(server, "learner", monkeypatch) as learner:
        pulled: Any = learner.pull(stream, "learner", traj, Struct, timeout_s=0.3)
        task: asyncio.Future[Any] = asyncio.ensure_future(anext(pulled))
        await asyncio.sleep(0.3)  # the consumer exists
        before = (await learner.js.stream_info(stream)).config
        async with connect(server, "actor-0", monkeypatch) as actor:
            shrunk = before.evolve(max_msgs=1)
            await refused(actor, actor.js.update_stream(shrunk))
            await refused(actor, actor.js.delete_consumer(stream, "learner"))
            await refused(actor, actor.js.add_consumer(stream, durable_name="mine"))
            await refused(actor, actor.js.purge_stream(stream))
            theirs = api.StreamConfig(name="SNOOP", subjects=[traj_subject(OTHER)])
            await refused(actor, actor.js.add_stream(theirs))
            await refused(actor, actor.js.update_stream(api.StreamConfig(
                name=stream_name(OTHER), subjects=[traj_subject(OTHER)], max_msgs=1)))  # fmt: skip
            await refused(actor, actor.publish(traj_subject(OTHER), Struct(), msg_id="x"))
            actor.nc._err = None  # so the next refusal is seen afresh
            await actor.nc.subscribe("_INBOX.learner.>")  # the learner's replies
            await actor.nc.flush()
            await asyncio.sleep(0.2)
            assert "permissions violation" in str(actor.nc.last_error).lower()
        async with connect(server, "driver-0", monkeypatch) as driver:
            await refused(driver, driver.js.delete_consumer(stream, "learner"))
            await refused(driver, driver.js.add_consumer(stream, durable_name="learner"))
        after = (await learner.js.stream_info(stream)).config
        assert after == before and after.max_msgs in (None, -1)
        assert (await learner.js.consumer_info(stream, "learner")).name == "learner"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
            await task
        await pulled.aclose()
    async with connect(server, LAUNCHER, monkeypatch) as admin:
        info = await admin.js.stream_info(stream_name(OTHER))
        assert info.state.messages == 0 and info.config.max_msgs in (None, -1)
        with pytest.raises(Exception):  # noqa: B017 - NotFoundError: never created
            await admin.js.stream_info("SNOOP")

"""The bus against a real nats-server: delivery guarantees, limits and process hygiene.

Each test names its own stream/subject/consumer (uuid) so that tests can share the
session server (tests/fixtures/nats.py) without seeing each other's messages.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from google.protobuf.struct_pb2 import Struct
from google.rpc.status_pb2 import Status

from rlfleet.bus.v1 import events_pb2
from services.bus import (
    TYPE_HEADER,
    Bus,
    Delivery,
    EmbeddedNats,
    events_subject,
    events_wildcard,
    stop_when_run_over,
    work_queue_stream,
    work_queue_subject,
)
from services.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

pytestmark = pytest.mark.timeout(60)


def _names() -> tuple[str, str]:
    """A fresh (stream, subject) pair."""
    tag = uuid.uuid4().hex[:10]
    return f"TEST_{tag}", f"test.{tag}.traj"


def _struct(**fields: object) -> Struct:
    msg = Struct()
    msg.update(fields)
    return msg


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _next(it: AsyncIterator[Delivery], timeout_s: float = 5.0) -> Delivery:
    return await asyncio.wait_for(anext(it), timeout_s)


async def _collect(bus: Bus, stream: str, durable: str, subject: str, seconds: float, **kw):
    """Everything the consumer hands out within ``seconds``, acked; stops via stop_event."""
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    got = []
    async for delivery in bus.pull(
        stream, durable, subject, Struct, timeout_s=0.2, stop_event=stop, **kw
    ):
        got.append(delivery)
        await delivery.ack()
    return got


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    async with Bus.connect(nats_server.url, name="test-bus") as connected:
        yield connected


# ---------------------------------------------------------------------------- JetStream


async def test_publish_pull_round_trip(bus: Bus) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    sent = _struct(obs=[1.0, 2.5], name="fragment")
    ack = await bus.publish(subject, sent, msg_id="m-1", headers={"x-extra": "yes"})
    assert (ack.stream, ack.seq, ack.duplicate) == (stream, 1, False)

    it = bus.pull(stream, "learner", subject, Struct, timeout_s=0.2)
    got = await _next(it)
    assert got.message == sent
    assert (got.subject, got.seq, got.num_delivered) == (subject, 1, 1)
    assert got.headers[TYPE_HEADER] == "google.protobuf.Struct"
    assert got.headers["Nats-Msg-Id"] == "m-1"
    assert got.headers["x-extra"] == "yes"
    await got.ack()
    assert got.settled
    with pytest.raises(FailedPrecondition, match="already acked"):
        await got.ack()
    await it.aclose()

    info = await bus.js.consumer_info(stream, "learner")
    assert (info.num_ack_pending, info.num_pending) == (0, 0)


async def test_duplicate_msg_id_is_stored_once(bus: Bus) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    first = await bus.publish(subject, _struct(i=1), msg_id="same")
    again = await bus.publish(subject, _struct(i=1), msg_id="same")
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq

    got = await _collect(bus, stream, "d", subject, seconds=0.6)
    assert [d.seq for d in got] == [first.seq]


async def test_durable_resumes_without_acked_and_redelivers_unacked(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    for i in range(4):
        await bus.publish(subject, _struct(i=i), msg_id=f"m{i}")
    settings = {"batch": 1, "ack_wait_s": 1.0}

    it = bus.pull(stream, "learner", subject, Struct, timeout_s=0.2, **settings)
    for _ in range(2):
        await (await _next(it)).ack()
    unacked = await _next(it)
    first_delivery = time.monotonic()
    assert unacked.seq == 3
    await it.aclose()
    await bus.close()  # the learner goes away with seq 3 in hand, not acked

    async with Bus.connect(nats_server.url, name="learner-again") as again:
        got = await _collect(again, stream, "learner", subject, seconds=2.0, **settings)
        by_seq = {d.seq: d for d in got}
        assert sorted(by_seq) == [3, 4]  # 1 and 2 were acked: never again
        assert by_seq[3].num_delivered == 2 and by_seq[4].num_delivered == 1
        assert by_seq[3].message["i"] == 2
    assert time.monotonic() - first_delivery >= 0.9  # seq 3 came back only after ack_wait


async def test_consumer_survives_a_server_restart(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = EmbeddedNats(store).start()
    restarted: EmbeddedNats | None = None
    try:
        async with Bus.connect(server.url, name="restart") as bus:
            stream, subject = _names()
            await bus.ensure_stream(stream, [subject])
            for i in range(2):
                await bus.publish(subject, _struct(i=i), msg_id=f"m{i}")
            it = bus.pull(stream, "learner", subject, Struct, batch=1, timeout_s=0.2)
            await (await _next(it)).ack()

            port = server.port
            server.stop()
            restarted = EmbeddedNats(store, port=port).start()  # same store, same address
            deadline = time.monotonic() + 5
            while bus.nc.stats["reconnects"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the client notices and reconnects on its own
            await bus.publish(subject, _struct(i=2), msg_id="m2")

            rest = [await _next(it), await _next(it)]
            assert [d.seq for d in rest] == [2, 3]
            assert all(d.num_delivered == 1 for d in rest)
            for d in rest:
                await d.ack()
            await it.aclose()
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


async def test_nak_redelivers_now_or_after_a_delay(bus: Bus) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(i=0), msg_id="m0")
    it = bus.pull(stream, "d", subject, Struct, timeout_s=0.2)

    first = await _next(it)
    await first.nak()
    second = await _next(it)
    assert (second.seq, second.num_delivered) == (first.seq, 2)

    await second.nak(delay_s=0.4)
    start = time.monotonic()
    third = await _next(it)
    assert time.monotonic() - start >= 0.3
    assert third.num_delivered == 3
    await third.in_progress()
    await third.ack()
    await it.aclose()


async def test_close_ends_an_active_pull_promptly(nats_server: EmbeddedNats) -> None:
    stream, subject = _names()
    bus = await Bus.connect(nats_server.url, name="closing")
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(i=0), msg_id="m0")
    got: list[Delivery] = []

    async def consume() -> None:
        async for delivery in bus.pull(stream, "d", subject, Struct, timeout_s=0.5):
            got.append(delivery)
            await delivery.ack()

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.02)
    start = time.monotonic()
    await bus.close()
    await asyncio.wait_for(task, 3)  # ends cleanly, no error
    assert time.monotonic() - start < 2


async def test_wrong_type_is_terminated_and_named(bus: Bus) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(i=0), msg_id="m0")

    it = bus.pull(stream, "d", subject, Status, timeout_s=0.2)
    with pytest.raises(InvalidArgument, match=r"expected a google\.rpc\.Status.*Struct") as info:
        await _next(it)
    assert "terminated" in str(info.value)
    await asyncio.sleep(0.1)
    consumer = await bus.js.consumer_info(stream, "d")
    assert (consumer.num_ack_pending, consumer.num_pending) == (0, 0)  # not redelivered


async def test_work_queue_serves_each_message_once(bus: Bus, nats_server: EmbeddedNats) -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    stream, subject = work_queue_stream(run, "prompts"), work_queue_subject(run, "prompts")
    await bus.ensure_stream(stream, [subject], retention="workqueue")
    total = 30
    for i in range(total):
        await bus.publish(subject, _struct(i=i), msg_id=f"p{i}")

    seen: dict[str, list[int]] = {"w1": [], "w2": []}
    stop = asyncio.Event()

    async def worker(name: str) -> None:
        async with Bus.connect(nats_server.url, name=name) as own:
            pulled = own.pull(
                stream, "workers", subject, Struct, batch=2, timeout_s=0.2, stop_event=stop
            )
            async for delivery in pulled:
                seen[name].append(int(delivery.seq or 0))
                await asyncio.sleep(0.01)  # some work, so that both workers get a share
                await delivery.ack()
                if sum(map(len, seen.values())) >= total:
                    stop.set()

    await asyncio.wait_for(asyncio.gather(worker("w1"), worker("w2")), 15)
    everything = seen["w1"] + seen["w2"]
    assert sorted(everything) == list(range(1, total + 1))  # none twice, none lost
    assert seen["w1"] and seen["w2"]
    info = await bus.js.stream_info(stream)
    assert info.state.messages == 0  # acked work is deleted

    other = bus.pull(stream, "other-workers", subject, Struct, timeout_s=0.2)
    with pytest.raises(FailedPrecondition, match="not unique"):
        await _next(other)


async def test_oversize_message_is_refused_before_sending(bus: Bus) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    limit = bus.max_payload
    with pytest.raises(InvalidArgument, match=rf"over the server's max payload of {limit} bytes"):
        await bus.publish(subject, _struct(blob="x" * limit), msg_id="big", by_reference=False)
    # Payload alone fits, headers push it over: the server would drop the connection.
    with pytest.raises(InvalidArgument, match=r"\d+ payload \+ \d+ headers"):
        await bus.publish(
            subject, _struct(blob="x" * (limit - 40)), msg_id="edge", by_reference=False
        )
    with pytest.raises(InvalidArgument):
        await bus.publish_event(subject, _struct(blob="x" * limit))
    assert bus.nc.is_connected
    assert (await bus.publish(subject, _struct(i=1), msg_id="small")).seq == 1


async def test_max_payload_option_reaches_the_server(tmp_path: Path) -> None:
    async with (
        EmbeddedNats(tmp_path / "nats", max_payload=4096) as server,
        Bus.connect(server.url, name="small") as bus,
    ):
        assert bus.max_payload == 4096
        stream, subject = _names()
        await bus.ensure_stream(stream, [subject])
        with pytest.raises(InvalidArgument, match="max payload of 4096 bytes"):
            await bus.publish(subject, _struct(blob="x" * 5000), msg_id="big", by_reference=False)


async def test_ensure_stream_is_idempotent_and_updates(bus: Bus) -> None:
    stream, subject = _names()
    created = await bus.ensure_stream(stream, [subject])
    same = await bus.ensure_stream(stream, [subject])
    assert same.created == created.created
    updated = await bus.ensure_stream(stream, [subject, subject + ".more"], max_age_s=60)
    assert updated.config.max_age == 60
    assert updated.config.duplicate_window == 60  # capped at max_age, as the server requires
    assert sorted(updated.config.subjects) == sorted([subject, subject + ".more"])
    with pytest.raises(FailedPrecondition, match="retention"):
        await bus.ensure_stream(stream, [subject], retention="workqueue")
    with pytest.raises(NotFound, match="ensure_stream"):
        await bus.publish("test.nostream." + uuid.uuid4().hex, _struct(), msg_id="x")


async def test_publish_carries_trace_context(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    telemetry = pytest.importorskip("services.telemetry")
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    monkeypatch.setattr(telemetry, "inject", lambda h: {**h, "traceparent": traceparent})
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(i=1), msg_id="t")
    got = await _collect(bus, stream, "d", subject, seconds=0.5)
    assert got[0].headers["traceparent"] == traceparent


async def test_publish_with_retry_resends_the_same_msg_id_until_acked(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    real, sent = bus.js.publish, []

    async def ack_lost_twice(subj: str, data: bytes, **kw: Any) -> Any:
        sent.append(kw["headers"]["Nats-Msg-Id"])
        ack = await real(subj, data, **kw)  # stored...
        if len(sent) < 3:
            raise TimeoutError  # ...but the ack does not come back in time
        return ack

    monkeypatch.setattr(bus.js, "publish", ack_lost_twice)
    ack = await bus.publish_with_retry(subject, _struct(i=1), msg_id="g-1", first_delay_s=0.01)
    assert sent == ["g-1"] * 3
    assert ack.duplicate and ack.seq == 1  # the retries found the first copy
    got = await _collect(bus, stream, "d", subject, seconds=0.6)
    assert [d.seq for d in got] == [1]


async def test_publish_with_retry_gives_up_or_fails_at_once(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    real, tries = bus.js.publish, []

    async def never_acked(subj: str, data: bytes, **kw: Any) -> Any:
        tries.append(time.monotonic())
        raise TimeoutError

    monkeypatch.setattr(bus.js, "publish", never_acked)
    with pytest.raises(Unavailable, match="retry with the same msg_id"):
        await bus.publish_with_retry(
            subject, _struct(i=1), msg_id="lost", attempts=3, first_delay_s=0.05
        )
    assert len(tries) == 3
    assert tries[2] - tries[1] >= tries[1] - tries[0] >= 0.05  # backing off, doubling
    # Not transient: raised by the first try.
    tries.clear()
    with pytest.raises(InvalidArgument, match="max payload"):
        await bus.publish_with_retry(
            subject, _struct(blob="x" * bus.max_payload), msg_id="big", by_reference=False
        )
    assert tries == []  # refused before sending
    monkeypatch.setattr(bus.js, "publish", real)
    with pytest.raises(NotFound, match="ensure_stream"):
        await bus.publish_with_retry("test.nostream." + uuid.uuid4().hex, _struct(), msg_id="x")
    with pytest.raises(InvalidArgument, match="attempts"):
        await bus.publish_with_retry(subject, _struct(), msg_id="x", attempts=0)


async def test_a_consumer_is_made_once_jetstream_answers_again(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a clustered stream elects a leader or a node comes back, JetStream requests meet
    "no responders" (NATS's 503) or the connection being re-made: Unavailable, and a pull
    consumer's creation is retried rather than failing its service."""
    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(i=7), msg_id="n-1")
    real, tries = bus.js.add_consumer, []
    transient = [nats.errors.NoRespondersError(), nats.errors.ConnectionReconnectingError()]

    async def not_yet(*args: Any, **kw: Any) -> Any:
        tries.append(1)
        if transient:
            raise transient.pop(0)
        return await real(*args, **kw)

    monkeypatch.setattr(bus.js, "add_consumer", not_yet)
    pulled = bus.pull(stream, "late", subject, Struct, timeout_s=0.3)
    delivery = await asyncio.wait_for(anext(pulled), 30)
    assert delivery.message["i"] == 7 and len(tries) == 3

    async def ack_unanswered(*args: Any, **kw: Any) -> Any:
        raise nats.errors.NoRespondersError  # the consumer's leader is gone

    monkeypatch.setattr(delivery._msg, "ack_sync", ack_unanswered)
    with pytest.raises(Unavailable, match="will be redelivered"):
        await delivery.ack()
    await pulled.aclose()

    async def no_responders(*args: Any, **kw: Any) -> Any:
        raise nats.errors.NoRespondersError

    monkeypatch.setattr(bus.js, "stream_info", no_responders)
    with pytest.raises(Unavailable, match=r"no answer from JetStream.*NoRespondersError"):
        await bus.ensure_stream(stream, [subject])


# ---------------------------------------------------------------------------- core NATS, KV


async def test_events_subscribe_by_type_or_by_header(bus: Bus) -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    everything = await bus.subscribe(events_wildcard(run), None)
    statuses = await bus.subscribe(events_subject(run, "status"), Status)
    await bus.publish_event(events_subject(run, "status"), Status(code=3, message="bad"))
    await bus.publish_event(events_subject(run, "metrics"), _struct(loss=0.5))

    first, second = await _next(everything), await _next(everything)
    assert isinstance(first.message, Status) and first.message.message == "bad"
    assert isinstance(second.message, Struct) and second.message["loss"] == 0.5
    assert second.seq is None
    await second.ack()  # core NATS: nothing to acknowledge, no error
    assert (await _next(statuses)).message.code == 3

    await everything.aclose()
    with pytest.raises(StopAsyncIteration):
        await _next(everything)

    async with await bus.subscribe(events_subject(run, "metrics"), Status) as wrong:
        await bus.publish_event(events_subject(run, "metrics"), _struct(loss=1.0))
        with pytest.raises(InvalidArgument, match=r"expected a google\.rpc\.Status"):
            await _next(wrong)
    await statuses.aclose()


async def test_kv_bucket_is_created_once_and_shared(bus: Bus, nats_server: EmbeddedNats) -> None:
    bucket = f"run_{uuid.uuid4().hex[:8]}"
    store = await bus.kv(bucket)
    await store.put("version", b"7")
    other = await Bus.connect(nats_server.url, name="reader")
    try:
        assert (await (await other.kv(bucket)).get("version")).value == b"7"
    finally:
        await other.close()
        await other.close()  # closing twice is fine
    with pytest.raises(InvalidArgument, match="bucket"):
        await bus.kv("bad name")


def _status(run: str, state: int) -> events_pb2.RunStatus:
    return events_pb2.RunStatus(run=run, state=state, source="test")


@pytest.mark.parametrize("over", [events_pb2.RUN_STATE_DONE, events_pb2.RUN_STATE_FAILED])
async def test_stop_when_run_over_sets_stop_at_done_or_failed(bus: Bus, over: int) -> None:
    run, other = f"t{uuid.uuid4().hex[:8]}", f"t{uuid.uuid4().hex[:8]}"
    stop = asyncio.Event()
    watch = await stop_when_run_over(bus, run, stop)  # subscribed once it returns
    await bus.publish_event(events_subject(other, "status"), _status(other, over))
    for state in (events_pb2.RUN_STATE_STARTING, events_pb2.RUN_STATE_RUNNING):
        await bus.publish_event(events_subject(run, "status"), _status(run, state))
    await bus.nc.flush()
    await asyncio.sleep(0.3)
    assert not stop.is_set() and not watch.done()  # another run's end, or not over yet
    await bus.publish_event(events_subject(run, "status"), _status(run, over))
    await asyncio.wait_for(watch, 5)
    assert stop.is_set() and watch.exception() is None


async def test_stop_when_run_over_cancels_cleanly_and_fails_on_garbage(bus: Bus) -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    stop = asyncio.Event()
    watch = await stop_when_run_over(bus, run, stop)
    await asyncio.sleep(0.05)
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch
    assert not stop.is_set()

    watch = await stop_when_run_over(bus, run, stop)
    await bus.publish_event(events_subject(run, "status"), _struct(state=3))
    with pytest.raises(InvalidArgument, match="RunStatus"):
        await asyncio.wait_for(watch, 5)
    assert not stop.is_set()


async def test_connect_to_nothing_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        start = time.monotonic()
        with pytest.raises(Unavailable, match=f"cannot connect to NATS at nats://127.0.0.1:{port}"):
            await Bus.connect(f"nats://127.0.0.1:{port}", name="nowhere")
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------- the server process


def test_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path)
    with server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        host, port = server.url.removeprefix("nats://").split(":")
        socket.create_connection((host, int(port)), timeout=1).close()
    assert not _alive(pid)
    assert server.pid is None
    server.stop()  # a second stop is a no-op
    assert "Server is ready" in server.log_path.read_text()


def test_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no-such-nats-server"
    with pytest.raises(ConfigError, match=r"no-such-nats-server.*does not exist"):
        EmbeddedNats(tmp_path / "a", binary=missing).start()
    monkeypatch.setenv("RLFLEET_NATS_SERVER", str(missing))
    with pytest.raises(ConfigError, match="RLFLEET_NATS_SERVER"):
        EmbeddedNats(tmp_path / "b").start()


def test_server_dying_at_start_reports_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "fake-nats-server"
    fake.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(Unavailable, match=r"(?s)exited with code 3.*boom: cannot start"):
        EmbeddedNats(tmp_path / "store", binary=fake).start()


def test_taken_port_reports_the_servers_words(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="address already in use"):
        EmbeddedNats(tmp_path, port=nats_server.port or 0).start()


# ---------------------------------------------------------------------------- by reference


async def test_oversize_messages_go_by_reference_and_are_deleted_after_ack(bus: Bus) -> None:
    from services.bus.payloads import PAYLOAD_HEADER, bucket_for

    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    big = _struct(blob="y" * (3 * bus.max_payload), i=7)  # three times what one message holds
    first = await bus.publish(subject, big, msg_id="frag-1")
    again = await bus.publish(subject, big, msg_id="frag-1")  # a retry: stored once
    assert not first.duplicate and again.duplicate
    info = await bus.js.stream_info(stream)
    assert info.state.messages == 1 and info.state.bytes < 4096  # only the reference
    pulled = bus.pull(stream, "refs", subject, Struct, timeout_s=0.5)
    delivery = await _next(pulled)
    assert delivery.headers[PAYLOAD_HEADER] == "ref"
    assert delivery.message == big
    store = await bus.js.object_store(bucket_for(subject))
    assert (await store.get("frag-1")).info.size == len(big.SerializeToString())
    await delivery.ack()
    with pytest.raises(nats.js.errors.ObjectNotFoundError):
        await store.get("frag-1")  # deleted once acknowledged
    await pulled.aclose()


async def test_a_reference_to_a_corrupted_payload_is_terminated(bus: Bus) -> None:
    from services.bus.payloads import bucket_for

    stream, subject = _names()
    await bus.ensure_stream(stream, [subject])
    await bus.publish(subject, _struct(blob="z" * (2 * bus.max_payload)), msg_id="frag-2")
    store = await bus.js.object_store(bucket_for(subject))
    await store.put("frag-2", b"tampered")
    pulled = bus.pull(stream, "refs-bad", subject, Struct, timeout_s=0.5)
    with pytest.raises(InvalidArgument, match="another digest than its reference"):
        await _next(pulled)
    await pulled.aclose()
    # The term is not confirmed (nats-py sends it and goes on): give the server a moment.
    deadline = asyncio.get_running_loop().time() + 5.0
    info = await bus.js.consumer_info(stream, "refs-bad")
    while info.num_ack_pending and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
        info = await bus.js.consumer_info(stream, "refs-bad")
    assert info.num_pending == 0 and info.num_ack_pending == 0  # terminated, not redelivered

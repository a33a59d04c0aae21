"""The prompt work queue (clients/trajectories/prompts.py) against a real nats-server.

Every test uses its own run name, hence its own queue stream, durable and feeder cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clients.trajectories.prompts import PromptFeeder, PromptQueue, prompt_key
from sampler.rollout.driver import RolloutDriver
from sampler.rollout.settings import RolloutSettings
from services.bus import Bus, EmbeddedNats, work_queue_stream
from services.errors import InvalidArgument
from services.ports import free_port
from services.registry import ServiceContext

pytestmark = pytest.mark.timeout(60)


def _run() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def _jsonl(path: Path, count: int) -> dict[str, str]:
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"{i}+1=", "answer": i + 1}) + "\n"
            for i in range(count)
        )
    )
    return {"jsonl": str(path)}


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    async with Bus.connect(nats_server.url, name="test-rollout-queue") as connected:
        yield connected


async def _messages(bus: Bus, run: str) -> int:
    info = await bus.js.stream_info(work_queue_stream(run, "prompts"))
    return int(info.state.messages)


async def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_two_drivers_get_every_prompt_exactly_once(
    bus: Bus, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    run, total = _run(), 60
    spec = _jsonl(tmp_path / "tasks.jsonl", total // 2)
    feeder = PromptFeeder(bus, run, "prompts", spec, depth=8, epochs=2)
    stop = asyncio.Event()
    seen: dict[str, list[str]] = {"a": [], "b": []}

    async def driver(name: str) -> None:
        async with Bus.connect(nats_server.url, name=f"driver-{name}") as own:
            queue = PromptQueue(own, run, "prompts", ack_wait_s=5.0, prefetch=3)
            await queue.start()
            try:
                while not stop.is_set():
                    batch = await queue.take(3, stop)
                    await asyncio.sleep(0.01)  # "generating", so both drivers get a share
                    seen[name] += [prompt_key(d.message) for d in batch]
                    await queue.ack(batch)
                    if sum(map(len, seen.values())) >= total:
                        stop.set()
            finally:
                await queue.close()

    await asyncio.wait_for(
        asyncio.gather(feeder.run_until(asyncio.Event()), driver("a"), driver("b")), 30
    )
    everything = seen["a"] + seen["b"]
    assert len(everything) == len(set(everything)) == total  # none twice, none lost
    expected = {f"{spec['jsonl']}/{epoch}/p{i}" for epoch in (0, 1) for i in range(total // 2)}
    assert set(everything) == expected
    assert seen["a"] and seen["b"]
    assert feeder.published == total
    assert await _messages(bus, run) == 0  # acked prompts leave the stream


async def test_prompts_of_a_dead_driver_are_redelivered(
    bus: Bus, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    run = _run()
    spec = _jsonl(tmp_path / "t.jsonl", 4)
    feeder = PromptFeeder(bus, run, "prompts", spec, depth=4, epochs=1)
    await asyncio.wait_for(feeder.run_until(asyncio.Event()), 5)  # exactly full: still ends
    never = asyncio.Event()

    # Driver A takes two prompts and dies: no ack, no nak, no more heartbeats.
    dying = await Bus.connect(nats_server.url, name="dying")
    doomed = PromptQueue(dying, run, "prompts", ack_wait_s=1.0, prefetch=1)
    await doomed.start()
    taken = await doomed.take(2, never, linger_s=1.0)
    assert len(taken) == 2
    for task in doomed._tasks:
        task.cancel()
    await asyncio.gather(*doomed._tasks, return_exceptions=True)
    held = {prompt_key(d.message) for d in doomed._held.values()}  # taken and prefetched
    await dying.nc.close()

    survivor = PromptQueue(bus, run, "prompts", ack_wait_s=1.0, prefetch=4)
    await survivor.start()
    got = []
    try:
        while len(got) < 4:
            batch = await asyncio.wait_for(survivor.take(4, never), 10)
            got += batch
            await survivor.ack(batch)
    finally:
        await survivor.close()
    keys = [prompt_key(d.message) for d in got]
    assert sorted(keys) == sorted({prompt_key(d.message) for d in got})  # none twice
    assert len(keys) == 4
    redelivered = {prompt_key(d.message) for d in got if d.num_delivered > 1}
    # Everything it held comes back (and possibly a prompt its last fetch had in flight).
    assert held <= redelivered
    assert {prompt_key(d.message) for d in taken} <= held
    assert await _messages(bus, run) == 0


async def test_a_stopping_driver_gives_its_prompts_back_at_once(
    bus: Bus, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    run = _run()
    spec = _jsonl(tmp_path / "t.jsonl", 5)
    await PromptFeeder(bus, run, "prompts", spec, depth=8, epochs=1).run_until(asyncio.Event())
    never = asyncio.Event()
    async with Bus.connect(nats_server.url, name="stopping") as own:
        stopping = PromptQueue(own, run, "prompts", ack_wait_s=30.0, prefetch=2)
        await stopping.start()
        assert len(await stopping.take(2, never, linger_s=1.0)) == 2
        await stopping.close()
    other = PromptQueue(bus, run, "prompts", ack_wait_s=30.0, prefetch=5)
    await other.start()
    got = []
    try:
        while len(got) < 5:  # long before the 30 s ack_wait
            got += await asyncio.wait_for(other.take(5, never, linger_s=0.2), 5)
        await other.ack(got)
    finally:
        await other.close()
    assert sorted(prompt_key(d.message) for d in got) == [
        f"{spec['jsonl']}/0/p{i}" for i in range(5)
    ]
    assert any(d.num_delivered > 1 for d in got)


async def test_live_driver_heartbeats_its_prompts_past_ack_wait(bus: Bus, tmp_path: Path) -> None:
    run = _run()
    feeder = PromptFeeder(bus, run, "prompts", _jsonl(tmp_path / "t.jsonl", 1), depth=4, epochs=1)
    await feeder.run_until(asyncio.Event())
    queue = PromptQueue(bus, run, "prompts", ack_wait_s=1.0, prefetch=1)
    await queue.start()
    try:
        (held,) = await queue.take(1, asyncio.Event())
        await asyncio.sleep(3.0)  # three ack_waits of "generation"
        await queue.ack([held])
        assert held.num_delivered == 1
    finally:
        await queue.close()
    assert await _messages(bus, run) == 0


async def test_feeder_keeps_queue_depth_and_refills(bus: Bus) -> None:
    run, depth = _run(), 10
    feeder = PromptFeeder(bus, run, "prompts", {"generator": "arith"}, depth=depth, poll_s=0.05)
    stop = asyncio.Event()
    feeding = asyncio.create_task(feeder.run_until(stop))
    sizes: list[int] = []
    try:
        await _eventually(lambda: _sized(bus, run, sizes, depth))
        queue = PromptQueue(bus, run, "prompts", ack_wait_s=5.0, prefetch=1)
        await queue.start()
        try:
            for _ in range(4):
                await queue.ack(await queue.take(1, stop))
            await _eventually(lambda: _sized(bus, run, sizes, depth))
            await asyncio.sleep(0.5)  # a full queue stays full, not fuller
            await _sized(bus, run, sizes, depth)
        finally:
            await queue.close()
    finally:
        stop.set()
        await asyncio.wait_for(feeding, 5)
    assert max(sizes) == depth
    assert feeder.published == depth + 4  # an infinite generator: only what was room for


async def _sized(bus: Bus, run: str, sizes: list[int], depth: int) -> bool:
    with contextlib.suppress(Exception):
        sizes.append(await _messages(bus, run))
    return bool(sizes) and sizes[-1] == depth


async def test_restarted_feeder_resumes_from_its_cursor(bus: Bus, tmp_path: Path) -> None:
    run = _run()
    spec = _jsonl(tmp_path / "t.jsonl", 10)
    first_stop = asyncio.Event()
    first = PromptFeeder(bus, run, "prompts", spec, depth=4, epochs=1, poll_s=0.05)
    feeding = asyncio.create_task(first.run_until(first_stop))
    await _eventually(lambda: _full(bus, run, 4))
    first_stop.set()
    await asyncio.wait_for(feeding, 5)
    assert first.published == 4

    second = PromptFeeder(bus, run, "prompts", spec, depth=4, epochs=1, poll_s=0.05)
    never = asyncio.Event()
    feeding = asyncio.create_task(second.run_until(never))
    queue = PromptQueue(bus, run, "prompts", ack_wait_s=5.0, prefetch=2)
    await queue.start()
    keys: list[str] = []
    try:
        while len(keys) < 10:
            batch = await asyncio.wait_for(queue.take(2, never), 10)
            keys += [prompt_key(d.message) for d in batch]
            await queue.ack(batch)
    finally:
        await queue.close()
    await asyncio.wait_for(feeding, 5)  # one epoch: the feeder ends
    assert keys == [f"{spec['jsonl']}/0/p{i}" for i in range(10)]
    assert second.published == 6  # resumed at task 4, did not try 0-3 again


async def _full(bus: Bus, run: str, depth: int) -> bool:
    try:
        return await _messages(bus, run) == depth
    except Exception:
        return False


async def test_driver_waits_for_its_peers_and_stops_cleanly(nats_server: EmbeddedNats) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    settings = RolloutSettings(
        sampler=nobody, reward_service=nobody, dataset={"generator": "arith"}, feed=True
    )
    ctx = ServiceContext(
        name="rollout-0",
        kind="rollout",
        settings=settings,
        run_name=_run(),
        nats_url=nats_server.url,
    )
    running = asyncio.create_task(RolloutDriver(ctx, settings).run())
    await asyncio.sleep(0.5)
    assert not running.done()  # still waiting for the sampler to come up
    ctx.stop_event.set()
    await asyncio.wait_for(running, 10)


async def test_image_prompts_travel_by_digest_and_come_back_whole(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    """A task's images go to the run's image store, never into the queue's messages; a driver
    gets the same bytes back by digest, and the group names them for the learner."""
    from clients.trajectories.groups import group_header, now
    from clients.trajectories.prompts import image_digests, with_image_bytes
    from common.datasets import iter_tasks, take
    from common.images import image_digest
    from services.bus.images import ImageStore

    run, spec = _run(), {"generator": "shapes", "split": "eval"}
    tasks = take(iter_tasks(spec), 3)
    feeder = PromptFeeder(bus, run, "prompts", spec, depth=3, epochs=1)
    stop = asyncio.Event()
    feeding = asyncio.create_task(feeder.run_until(stop))
    async with Bus.connect(nats_server.url, name="driver-images") as own:
        queue = PromptQueue(own, run, "prompts", ack_wait_s=5.0, prefetch=3)
        await queue.start()
        try:
            batch = []
            while len(batch) < 3:
                batch += await queue.take(3 - len(batch), stop)
            store = ImageStore(own.payloads, run)
            for delivery, task in zip(batch, tasks, strict=True):
                message = delivery.message
                assert image_digests(message) == [image_digest(d) for d in task.images]
                assert all(
                    not part.image.data for m in message.chat.messages for part in m.parts
                )  # by digest only
                inlined = await with_image_bytes(message, store)
                sent = [
                    p.image.data for m in inlined.chat.messages for p in m.parts if p.image.data
                ]
                assert sent == list(task.images)
                header = group_header(run, "driver-images", message, now())
                assert list(header.image_sha256) == image_digests(message)
                assert header.prompt_text.startswith("<image>")
            await queue.ack(batch)
            gone = message.__class__()
            gone.CopyFrom(message)
            gone.chat.messages[0].parts[0].image.sha256 = "0" * 64
            with pytest.raises(InvalidArgument, match="gone"):
                await with_image_bytes(gone, store)
        finally:
            stop.set()
            await queue.close()
            await asyncio.gather(feeding, return_exceptions=True)

"""sampler/lm/gate.py: generations in flight keep their version; later ones wait for the update."""

from __future__ import annotations

import asyncio

from sampler.lm.gate import VersionGate


async def test_update_waits_for_running_generations_and_holds_new_ones() -> None:
    gate = VersionGate(3)
    events: list[str] = []
    release_first = asyncio.Event()

    async def generation(name: str, hold: asyncio.Event | None = None) -> int:
        async with gate.reading() as version:
            events.append(f"{name} starts on v{version}")
            if hold is not None:
                await hold.wait()
            events.append(f"{name} ends")
            return version

    async def update() -> None:
        async with gate.writing():
            events.append("update")
            gate.version = 4

    first = asyncio.create_task(generation("first", release_first))
    await asyncio.sleep(0)
    updating = asyncio.create_task(update())
    await asyncio.sleep(0)
    assert gate.writers_waiting == 1 and gate.readers == 1
    late = asyncio.create_task(generation("late"))  # arrives while the update waits
    await asyncio.sleep(0.01)
    assert events == ["first starts on v3"]
    release_first.set()
    assert await first == 3 and await late == 4
    await updating
    assert events == [
        "first starts on v3",
        "first ends",
        "update",
        "late starts on v4",
        "late ends",
    ]


async def test_cancelled_update_lets_held_generations_go() -> None:
    gate = VersionGate(0)
    hold = asyncio.Event()

    async def running() -> None:
        async with gate.reading():
            await hold.wait()

    async def update() -> None:
        async with gate.writing():
            gate.version = 1

    reader = asyncio.create_task(running())
    await asyncio.sleep(0)
    writer = asyncio.create_task(update())
    await asyncio.sleep(0)
    held = asyncio.create_task(running())
    await asyncio.sleep(0.01)
    assert gate.readers == 1  # `held` waits behind the update
    writer.cancel()
    await asyncio.sleep(0.01)
    assert gate.readers == 2 and gate.version == 0
    hold.set()
    await asyncio.gather(reader, held)

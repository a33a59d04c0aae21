"""What `rlfleet up` calls gone (launch/producers.py) and the waits that say what they wait for
(services/waits.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from google.protobuf import json_format

from launch.producers import ProducerWatch
from services.producers import ProducerReport, producer_record
from services.waits import waiting


def _record(source: str, live: int, change: str = "link 1 ended") -> ProducerReport:
    fields = json_format.MessageToDict(
        producer_record(source, live=live, what="game links", change=change)
    )
    report = ProducerReport.from_fields(fields)
    assert report is not None
    return report


RUNNING = {"env-0": "healthy", "game-0": "running", "learner": "healthy"}


def test_a_server_no_game_has_linked_is_waiting_not_gone() -> None:
    watch = ProducerWatch({"env-0": "rollout fragments"}, "learner", grace_s=0)
    assert watch.check(RUNNING, None, now=0.0) is None
    assert watch.check(RUNNING, None, now=100.0) is None


def test_the_last_link_ending_is_said_once_the_grace_has_passed_and_again_later() -> None:
    watch = ProducerWatch({"env-0": "rollout fragments"}, "learner", grace_s=3, repeat_s=30)
    line = watch.report(_record("env-0", 1, "game snake linked"))
    assert line == "env-0: game snake linked (1 game links live)"
    assert watch.report(_record("env-0", 0)) is None
    assert watch.check(RUNNING, "step 44/1M", now=10.0) is None  # within the grace
    line = watch.check(RUNNING, "step 44/1M", now=13.0)
    assert line == (
        "no producer of training data left: env-0 (its last game link ended: link 1 ended); "
        "learner still waits for rollout fragments at step 44/1M"
    )
    assert watch.check(RUNNING, None, now=20.0) is None
    assert (again := watch.check(RUNNING, None, now=43.0)) is not None
    assert again.endswith("(33 s)")
    # A game comes back: said, and the watch is armed again.
    assert watch.report(_record("env-0", 1, "game snake linked")) is not None
    assert watch.check(RUNNING, None, now=44.0) is None
    assert not watch.said


def test_a_service_starting_or_restarting_holds_the_verdict() -> None:
    watch = ProducerWatch({"actor-0": "rollout fragments"}, "learner", grace_s=0)
    states = {"actor-0": "finished", "game-0": "restarting", "learner": "healthy"}
    assert watch.check(states, None, now=0.0) is None
    states["game-0"] = "running"
    assert "actor-0 (finished)" in (watch.check(states, None, now=1.0) or "")


def test_nothing_is_said_once_the_consumer_itself_has_finished() -> None:
    watch = ProducerWatch({"actor-0": "rollout fragments"}, "learner", grace_s=0)
    assert watch.check({"actor-0": "finished", "learner": "finished"}, None, now=5.0) is None


def test_one_live_producer_is_enough() -> None:
    watch = ProducerWatch({"actor-0": "f", "actor-1": "f"}, "learner", grace_s=0)
    states = {"actor-0": "finished", "actor-1": "running", "learner": "healthy"}
    assert watch.check(states, None, now=5.0) is None


async def test_a_long_wait_says_what_it_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    said: list[str] = []
    count = iter(range(100))

    async def say(line: str) -> None:
        said.append(line)

    async def slow() -> str:
        await asyncio.sleep(0.35)
        return "done"

    with caplog.at_level(logging.INFO, logger="rlfleet.waits"):
        got = await waiting(lambda: f"fragments ({next(count)})", slow(), say=say, every_s=0.1)
    assert got == "done"
    assert len(said) == 3 and said[0] == "waiting for fragments (0) (0 s)", said
    assert said[-1].startswith("waiting for fragments (2)")
    assert "waiting for fragments (0)" in caplog.text


async def test_a_quick_wait_says_nothing_and_cancelling_cancels_the_step() -> None:
    said: list[str] = []

    async def say(line: str) -> None:
        said.append(line)

    assert await waiting("x", asyncio.sleep(0, "ok"), say=say, every_s=0.1) == "ok"
    assert said == []
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.create_task(waiting("y", forever(), every_s=10))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()


def test_producers_stopping_after_the_run_is_over_are_no_stall() -> None:
    # Actors stop at the learner's DONE status while the learner still closes down.
    watch = ProducerWatch({"actor-0": "rollout fragments"}, "learner", grace_s=0)
    watch.run_over = True
    assert watch.check({"actor-0": "finished", "learner": "healthy"}, None, now=5.0) is None

"""Rollout pacing: how many groups a driver starts before it waits for a version."""

from __future__ import annotations

import asyncio

import pytest

from clients.trajectories.pacing import Pacer, VersionWatch

pytestmark = pytest.mark.timeout(30)


async def _started_without_waiting(pacer: Pacer, stop: asyncio.Event, calls: int) -> int:
    """Groups started (one per call) before a call would have to wait."""
    for started in range(calls):
        turn = asyncio.ensure_future(pacer.wait_turn(stop))
        await asyncio.sleep(0.01)
        if not turn.done():
            turn.cancel()
            return started
        assert turn.result()
        pacer.count(1)
    return calls


@pytest.mark.parametrize(("lag", "free"), [(0, 2), (1, 4), (2, 6)])
async def test_driver_runs_at_most_lag_versions_of_groups_ahead(lag: int, free: int) -> None:
    watch, stop = VersionWatch(version=5), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=2, max_policy_lag=lag, version_wait_s=30)
    assert await _started_without_waiting(pacer, stop, 10) == free
    waiting = asyncio.ensure_future(pacer.wait_turn(stop))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await watch.observe(6)  # the learner trained on the first two groups
    assert await asyncio.wait_for(waiting, 1)
    pacer.count(1)
    assert await _started_without_waiting(pacer, stop, 10) == 1  # two more per version


async def test_no_groups_per_version_never_waits_and_stop_ends_a_wait() -> None:
    watch, stop = VersionWatch(), asyncio.Event()
    free = Pacer(watch, groups_per_version=None, max_policy_lag=0, version_wait_s=30)
    assert await _started_without_waiting(free, stop, 50) == 50
    paced = Pacer(watch, groups_per_version=1, max_policy_lag=0, version_wait_s=30)
    paced.count(0)
    assert await paced.wait_turn(stop)
    paced.count(1)
    waiting = asyncio.ensure_future(paced.wait_turn(stop))
    await asyncio.sleep(0.01)
    stop.set()
    assert await asyncio.wait_for(waiting, 1) is False


async def test_pacing_restarts_from_the_current_version_after_a_long_wait() -> None:
    watch, stop = VersionWatch(version=3), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=1, max_policy_lag=0, version_wait_s=0.1)
    assert await pacer.wait_turn(stop)
    pacer.count(1)
    assert await asyncio.wait_for(pacer.wait_turn(stop), 2)  # v4 never came
    assert (pacer.base, pacer.started) == (3, 0)


async def test_driver_waits_until_the_samplers_serve_the_announced_version() -> None:
    """A group generated between the announcement and the sampler's reload would carry the old
    version (stale for the learner), so the turn waits for the samplers' GetInfo version too."""
    watch, stop = VersionWatch(version=0), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=1, max_policy_lag=0, version_wait_s=30)
    served = {"version": 0}

    async def loaded() -> int:
        return served["version"]

    pacer.loaded_version = loaded
    assert await pacer.wait_turn(stop)
    pacer.count(1)
    await watch.observe(1)  # announced; the sampler is still on v0
    turn = asyncio.ensure_future(pacer.wait_turn(stop))
    await asyncio.sleep(0.1)
    assert not turn.done()
    served["version"] = 1
    assert await asyncio.wait_for(turn, 1)


async def test_credit_for_dropped_groups_lets_a_waiting_driver_start_more() -> None:
    """Groups the learner drops untrained (DAPO's filter) give their start back: the learner
    needs as many more before it can reach the version the driver waits for."""
    watch, stop = VersionWatch(version=5), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=2, max_policy_lag=0, version_wait_s=30)
    for name in ("a", "b"):
        assert await pacer.wait_turn(stop)
        pacer.count(1, [name])
    waiting = asyncio.ensure_future(pacer.wait_turn(stop))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # needs v6, which needs two trained groups
    assert pacer.credit(["not-mine"]) == 0  # another driver's (or incarnation's) group
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert pacer.credit(["a"]) == 1  # "a" was filtered out: one more group may start
    assert await asyncio.wait_for(waiting, 1)
    pacer.count(1, ["c"])
    assert pacer.credit(["a"]) == 0  # each group is credited once (a redelivered drop)
    assert (pacer.started, pacer.credited) == (2, 1)
    assert await _started_without_waiting(pacer, stop, 5) == 0
    await watch.observe(6)  # "b" and "c" trained
    assert await _started_without_waiting(pacer, stop, 5) == 2


async def test_credit_is_forgotten_when_pacing_restarts() -> None:
    watch, stop = VersionWatch(version=3), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=1, max_policy_lag=0, version_wait_s=0.1)
    assert await pacer.wait_turn(stop)
    pacer.count(1, ["a"])
    assert await asyncio.wait_for(pacer.wait_turn(stop), 2)  # v4 never came: restart at v3
    pacer.count(1, ["b"])
    assert pacer.credit(["a"]) == 0  # counted before the restart: credit would be extra
    assert pacer.credit(["b"]) == 1 and pacer.started == 0


async def test_drops_of_this_driver_are_taken_from_the_learners_events() -> None:
    from rlfleet.bus.v1 import events_pb2
    from services.bus import Delivery
    from services.errors import InvalidArgument

    class Subscription:
        def __init__(self, items: list[object]) -> None:
            self.items = items

        async def __aenter__(self) -> Subscription:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def __anext__(self) -> Delivery[events_pb2.GroupsDropped]:
            if not self.items:
                raise StopAsyncIteration
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, events_pb2.GroupsDropped)
            return Delivery(message=item, subject="s", headers={})

    def dropped(producer: str, *ids: str) -> events_pb2.GroupsDropped:
        return events_pb2.GroupsDropped(
            run="r", producer=producer, count=len(ids), reason="uniform", group_ids=ids
        )

    pacer = Pacer(VersionWatch(), groups_per_version=4, max_policy_lag=0, version_wait_s=30)
    pacer.count(3, ["r/d/0/1", "r/d/0/2", "r/d/0/3"])
    events: list[object] = [
        dropped("rollout-1", "r/d/0/1"),  # same id, another driver's group: not ours
        InvalidArgument("not a GroupsDropped"),  # skipped, the watch goes on
        dropped("rollout-0", "r/d/0/1", "r/d/0/3"),
    ]
    await pacer._follow(Subscription(events), "rollout-0")
    assert (pacer.started, pacer.credited) == (1, 2)


async def test_a_call_never_starts_groups_past_the_next_version_boundary() -> None:
    """All groups of a call start on one turn: after a credit left the count between version
    boundaries, a full call would start its later groups a version early (stale when trained),
    so the turn offers only the groups up to the boundary."""
    watch, stop = VersionWatch(version=5), asyncio.Event()
    pacer = Pacer(watch, groups_per_version=4, max_policy_lag=1, version_wait_s=30)
    assert pacer.room(4) == 4 and pacer.room(3) == 3
    assert await pacer.wait_turn(stop)
    pacer.count(4, ["a", "b", "c", "d"])  # v5's turn: trained at v6
    assert pacer.credit(["b"]) == 1  # dropped: the learner needs one more for v6
    assert pacer.room(4) == 1  # one more for v6; the ones after it are v7's
    assert await pacer.wait_turn(stop)
    pacer.count(pacer.room(4), ["e"])
    assert pacer.room(4) == 4
    assert await pacer.wait_turn(stop)  # lag 1: v7's groups start on v5's weights too
    pacer.count(4, ["f", "g", "h", "i"])
    waiting = asyncio.ensure_future(pacer.wait_turn(stop))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # v8's groups wait for v6
    await watch.observe(6)
    assert await asyncio.wait_for(waiting, 1)
    assert Pacer(watch, None, 1, 30).room(16) == 16  # not paced

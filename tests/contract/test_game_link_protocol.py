"""GameLink protocol clarifications against a real env server (service.main) and a real bus:

- policy versions: Welcome.policy_loaded tells "nothing loaded yet" from "version 0 loaded"
  (versions are the learner's: 0 is its initial weights); Welcome.policy names the policy.
- episode ids: the server refuses only the id of an episode that ended at the previous tick;
  an id an agent used earlier in the link starts a new episode.
- episodes the server cuts off (Goodbye, a break that did not continue, a takeover, an id
  changed without an end) go out as EpisodeStats marked partial (the learner's mean return and
  target_return leave them out: tests/unit/test_game_link_episodes.py).

The server and raw-stream helpers are those of tests/contract/test_game_link.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlfleet.bus.v1 import events_pb2
from rlfleet.env.v1 import game_link_pb2
from services.bus import events_subject
from services.ports import free_port
from tests.contract.test_game_link import Stream, batch, hello, own_server

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]


async def test_welcome_says_whether_a_policy_is_loaded(nats_url: str) -> None:
    async with own_server(nats_url) as srv:  # policy: random, answers at once
        stream = Stream(srv.address)
        try:
            welcome = (await stream.ask(hello=hello())).welcome
            assert (welcome.policy_loaded, welcome.policy, welcome.policy_version) == (
                True,
                "random",
                0,
            )
            assert (await stream.ask(observations=batch(1))).actions.policy_version == 0
        finally:
            await stream.close()
    # policy: learner before the learner's first version: version 0 but nothing loaded.
    learner = f"127.0.0.1:{free_port()}"
    async with own_server(nats_url, policy="learner", learner=learner) as srv:
        stream = Stream(srv.address)
        try:
            welcome = (await stream.ask(hello=hello())).welcome
            assert (welcome.policy_loaded, welcome.policy, welcome.policy_version) == (
                False,
                "learner",
                0,
            )
        finally:
            await stream.close()


async def test_an_earlier_episode_id_may_come_back(nats_url: str) -> None:
    """Only the row right after an episode's end must change its id (the proto's rule)."""
    async with own_server(nats_url) as srv:
        stream = Stream(srv.address)
        try:
            assert (await stream.ask(hello=hello())).HasField("welcome")
            steps: list[tuple[int, Any]] = [
                (1, {"episode_ids": (1, 2)}),
                (2, {"episode_ids": (1, 2), "terminated": (True, False)}),
                (3, {"episode_ids": (7, 2)}),
                (4, {"episode_ids": (7, 2), "terminated": (True, False)}),
                (5, {"episode_ids": (1, 2)}),  # agent 0's first id again: a new episode
            ]
            for tick, fields in steps:
                response = await stream.ask(observations=batch(tick, **fields))
                assert response.HasField("actions"), (tick, response.error)
            farewell = (await stream.ask(goodbye=game_link_pb2.Goodbye())).farewell
            assert farewell.episodes == 2
        finally:
            await stream.close()


async def test_episodes_cut_off_are_published_partial(nats_url: str) -> None:
    async with own_server(nats_url, stats_interval_s=60.0) as srv:
        sub = await srv.bus.subscribe(events_subject(srv.run, "episodes"), events_pb2.EpisodeStats)
        await srv.bus.nc.flush()  # the subscription is live at the server before the game plays
        seen: list[events_pb2.EpisodeStats] = []

        async def collect() -> None:
            async with sub:
                async for delivery in sub:
                    seen.append(delivery.message)

        collector = asyncio.create_task(collect())
        stream = Stream(srv.address)
        try:
            assert (await stream.ask(hello=hello())).HasField("welcome")
            for tick in range(1, 4):  # 2 steps each, then agent 0 terminates at tick 4
                assert (await stream.ask(observations=batch(tick, rewards=1.0))).HasField("actions")
            ended = batch(4, rewards=1.0, terminated=(True, False))
            assert (await stream.ask(observations=ended)).HasField("actions")
            for tick in (5, 6):
                response = await stream.ask(observations=batch(tick, episode_ids=(3, 2)))
                assert response.HasField("actions")
            # Goodbye with agent 0 one step and agent 1 five steps into their episodes.
            assert (await stream.ask(goodbye=game_link_pb2.Goodbye())).HasField("farewell")
            for _ in range(200):
                if len(seen) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert len(seen) == 3, seen
        finally:
            await stream.close()
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
        whole = [(e.length, e.episode_return) for e in seen if not e.partial]
        cut = sorted((e.length, e.truncated) for e in seen if e.partial)
        assert whole == [(3, 3.0)]  # agent 0's episode, ended by the game
        assert cut == [(1, True), (5, True)]  # both open episodes, ended by the Goodbye

"""Episodes a game link cuts off (a break that did not continue, a takeover, Goodbye, the link's
end, an episode id changed without an end) are `partial`: published marked so and left out of
the mean return, the actor's (common/stats.py) and the learner's (charts/episodic_return,
target_return), so a cut-off episode can neither trigger nor delay `target_return`."""

from __future__ import annotations

import asyncio

import gymnasium as gym
import numpy as np

from common.behaviour import Decision
from common.stats import ActorStats
from env_server.game_link.protocol import Tick
from env_server.game_link.recorder import LinkRecorder
from rlfleet.bus.v1 import events_pb2
from tests.fixtures.episodes import EpisodeFeed, RecordingBus, bare_game_workload

N = 2


def recorder() -> LinkRecorder:
    return LinkRecorder(
        N, gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3), 4, has_values=False
    )


def tick(t: int, ids: tuple[int, int], *, terminated: tuple[bool, bool] = (False, False)) -> Tick:
    return Tick(
        t,
        np.zeros((N, 3), np.float32),
        np.ones(N, np.float32),
        np.array(terminated),
        np.zeros(N, bool),
        np.array(ids, np.int64),
    )


DECISION = Decision(np.zeros(N, np.int64), np.zeros(N, np.int64), np.zeros(N, np.float32), None)


def test_episodes_the_game_ends_are_whole_those_the_server_cuts_are_partial() -> None:
    r = recorder()
    assert r.record(tick(1, (1, 2)), DECISION, 0) == []
    assert r.record(tick(2, (1, 2)), DECISION, 0) == []
    ended = r.record(tick(3, (1, 2), terminated=(True, False)), DECISION, 0)
    assert [(e.agent, e.length, e.truncated, e.partial) for e in ended] == [(0, 2, False, False)]
    # Agent 1's id changes without an end: its episode is cut off at its last complete
    # transition (2 steps; the decision of tick 3 never got its reward), partial.
    ended = r.record(tick(4, (3, 9)), DECISION, 0)
    assert [(e.agent, e.length, e.truncated, e.partial) for e in ended] == [(1, 2, True, True)]
    r.record(tick(5, (3, 9)), DECISION, 0)
    # Goodbye / a break that did not continue: every open episode ends partial.
    ended = r.end_episodes()
    assert sorted((e.agent, e.length, e.partial) for e in ended) == [(0, 1, True), (1, 1, True)]


def test_a_reused_episode_id_starts_a_new_episode() -> None:
    """The server only refuses the ended id in the very next row (protocol.check_tick); an id
    used earlier in the link starts a new episode like any other change."""
    r = recorder()
    r.record(tick(1, (1, 2)), DECISION, 0)
    r.record(tick(2, (1, 2), terminated=(True, False)), DECISION, 0)
    r.record(tick(3, (5, 2)), DECISION, 0)
    r.record(tick(4, (5, 2), terminated=(True, False)), DECISION, 0)
    r.record(tick(5, (1, 2)), DECISION, 0)  # agent 0's first id again
    ended = r.record(tick(6, (1, 2), terminated=(True, False)), DECISION, 0)
    assert [(e.agent, e.length, e.partial) for e in ended] == [(0, 1, False)]
    # Server-side ids are numbered per link across agents: 0 and 1 at tick 1, 2 at tick 3, and
    # now 3, a new episode rather than episode 0 again.
    assert r.agents[0].episode == 3


def test_actor_stats_publish_partial_episodes_marked_and_out_of_the_mean() -> None:
    bus = RecordingBus()
    stats = ActorStats(bus, "run", "env-0/link-1", "Game-v0", 5.0)  # type: ignore[arg-type]
    asyncio.run(stats.episodes_ended([(0, 10.0, 10, False)], 3))
    asyncio.run(stats.episodes_ended([(1, 500.0, 50, True)], 3, partial=True))
    assert [(e.episode_return, e.partial, e.truncated) for e in bus.events] == [
        (10.0, False, False),
        (500.0, True, True),
    ]
    scalars = stats.scalars(stats.started + 1.0)
    assert scalars["charts/episodic_return"] == 10.0
    assert scalars["charts/episodic_length"] == 10.0
    assert scalars["charts/episodes"] == 2.0


def test_learner_leaves_partial_episodes_out_of_return_and_target() -> None:
    workload = bare_game_workload(total_timesteps=10**9, episode_window=2, target_return=100.0)
    episodes = [
        events_pb2.EpisodeStats(episode_return=150.0, length=150),
        events_pb2.EpisodeStats(episode_return=150.0, length=150),
        # Cut off at a break: short, low returns that would pull the mean under the target.
        events_pb2.EpisodeStats(episode_return=3.0, length=3, truncated=True, partial=True),
        events_pb2.EpisodeStats(episode_return=2.0, length=2, truncated=True, partial=True),
    ]
    asyncio.run(workload._watch_episodes(EpisodeFeed(episodes)))
    assert list(workload.returns) == [150.0, 150.0]
    assert workload.episodes == 2
    assert workload._end_reason(0, workload.returns) is not None  # the target is reached

    workload.returns.clear()
    partial_high = [
        events_pb2.EpisodeStats(episode_return=10.0, length=10),
        events_pb2.EpisodeStats(episode_return=900.0, length=900, truncated=True, partial=True),
        events_pb2.EpisodeStats(episode_return=900.0, length=900, truncated=True, partial=True),
    ]
    asyncio.run(workload._watch_episodes(EpisodeFeed(partial_high)))
    assert list(workload.returns) == [10.0]
    assert workload._end_reason(0, workload.returns) is None  # partial ones cannot trigger it

"""The game's own episode score (info["score"]) end to end: the env pool reads it when an episode
ends, a game link reads it from the end tick's infos, and the actors' and the learner's
charts/episodic_score average it over the same window as the return, only over episodes that
had one, and are absent when none did (no made-up 0)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from common import tensor
from common.behaviour import Decision
from common.stats import WINDOW, ActorStats
from env_server.game_link.protocol import LinkSpec, TickCursor, check_tick
from env_server.game_link.recorder import LinkRecorder
from env_server.pool import EnvPool, _score
from rlfleet.bus.v1 import events_pb2
from rlfleet.env.v1 import game_link_pb2
from tests.fixtures.episodes import EpisodeFeed, RecordingBus, bare_game_workload


class ScoredEnv(gym.Env[np.ndarray, np.int64]):
    """Ends every `length` steps with info["score"] = `score` (absent when None)."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, score: Any, length: int = 3) -> None:
        self.score, self.length, self.t = score, length, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        done = self.t >= self.length
        # Mid-episode scores must not matter: only the last step's info is read.
        info: dict[str, Any] = {} if done else {"score": -99.0}
        if done and self.score is not None:
            info["score"] = self.score
        return np.zeros(2, np.float32), 1.0, done, False, info


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, 7.0),
        (np.int64(3), 3.0),
        (np.float32(2.5), 2.5),
        (np.array(4.0), 4.0),
        (None, None),
        (True, None),  # a flag, not a score
        ("12", None),
        (float("nan"), None),
        (np.array([1.0, 2.0]), None),
        (1 + 2j, None),
    ],
)
def test_score_reads_finite_real_numbers_only(value: Any, expected: float | None) -> None:
    assert _score({"score": value}) == expected


@pytest.mark.parametrize("mode", ["SAME_STEP", "NEXT_STEP"])
def test_pool_episodes_carry_the_final_infos_score_and_none_without_one(mode: str) -> None:
    from gymnasium.vector import AutoresetMode

    scores = iter([5, None])
    pool = EnvPool(lambda: ScoredEnv(next(scores)), 2, autoreset_mode=AutoresetMode[mode])
    pool.reset(seed=0)
    ended = []
    for _ in range(3):
        ended += pool.step(np.zeros(2, np.int64)).episodes
    assert [(e.env_index, e.score) for e in ended] == [(0, 5.0), (1, None)]
    pool.close()


def test_actor_stats_average_scores_over_the_window_and_publish_them() -> None:
    bus = RecordingBus()
    stats = ActorStats(bus, "run", "actor-0", "Snake-v0", 5.0)  # type: ignore[arg-type]
    asyncio.run(stats.episodes_ended([(0, 1.0, 5, False, None), (1, 2.0, 6, False)], 0))
    assert "charts/episodic_score" not in stats.scalars(stats.started + 1.0)
    assert not any(e.HasField("score") for e in bus.events)  # unset, not 0
    asyncio.run(stats.episodes_ended([(0, 3.0, 7, False, 4.0), (1, 4.0, 8, False, 8.0)], 0))
    # A partial episode's score stays out of the mean, like its return.
    asyncio.run(stats.episodes_ended([(0, 9.0, 9, True, 100.0)], 0, partial=True))
    assert [e.score for e in bus.events if e.HasField("score")] == [4.0, 8.0, 100.0]
    assert stats.scalars(stats.started + 1.0)["charts/episodic_score"] == 6.0
    # Once the scored episodes leave the window, the chart goes away again.
    asyncio.run(stats.episodes_ended([(0, 1.0, 1, False)] * WINDOW, 0))
    assert "charts/episodic_score" not in stats.scalars(stats.started + 1.0)


def test_learner_reports_episodic_score_only_when_episodes_had_one() -> None:
    workload = learner(window=3)
    scoreless = [events_pb2.EpisodeStats(episode_return=1.0, length=10) for _ in range(2)]
    asyncio.run(workload._watch_episodes(EpisodeFeed(scoreless)))
    metrics = report(workload)
    assert metrics["charts/episodic_return"] == 1.0
    assert "charts/episodic_score" not in metrics
    scored = [
        events_pb2.EpisodeStats(episode_return=-1.0, length=10, score=3.0),
        events_pb2.EpisodeStats(episode_return=0.0, length=10, score=0.0),  # a real 0 counts
        events_pb2.EpisodeStats(episode_return=5.0, length=5, score=50.0, partial=True),
    ]
    asyncio.run(workload._watch_episodes(EpisodeFeed(scored)))
    metrics = report(workload)
    # Window 3: one scoreless and two scored episodes; the partial one is left out.
    assert metrics["charts/episodic_return"] == 0.0
    assert metrics["charts/episodic_score"] == 1.5
    # Checkpointed and restored with the returns.
    again = learner(window=3)
    again.restore(workload.state())
    assert report(again)["charts/episodic_score"] == 1.5


def test_a_game_links_end_tick_infos_score_becomes_the_episodes_score() -> None:
    n = 3
    spec = LinkSpec(
        "game", "Game-v0", gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(2), n,
        "key", 1,
    )  # fmt: skip
    r = LinkRecorder(n, spec.observation_space, spec.action_space, 4, has_values=False)
    decision = Decision(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.float32), None)
    cursor = TickCursor()

    def tick(t: int, done: bool, infos: dict[str, np.ndarray] | None = None) -> Any:
        batch = game_link_pb2.ObservationBatch(
            tick=t,
            observations=tensor.encode_tree(np.zeros((n, 2), np.float32)),
            rewards=tensor.encode(np.ones(n, np.float32)),
            terminated=tensor.encode(np.full(n, done)),
            truncated=tensor.encode(np.zeros(n, bool)),
            episode_ids=tensor.encode(np.zeros(n, np.int64)),
        )
        if infos is not None:
            batch.infos.CopyFrom(tensor.encode_tree(infos))
        checked = check_tick(batch, spec, cursor)
        cursor.advance(checked)
        return checked

    r.record(tick(1, False, {"score": np.array([-5.0, -5.0, -5.0])}), decision, 0)
    # Agent 0 reports a score, agent 1's mask is off, agent 2's is NaN: only agent 0 has one.
    infos = {"score": np.array([12.0, 7.0, np.nan]), "_score": np.array([True, False, True])}
    ended = r.record(tick(2, True, infos), decision, 0)
    assert [(e.agent, e.score) for e in ended] == [(0, 12.0), (1, None), (2, None)]
    assert ended[0].as_tuple()[4] == 12.0
    # No infos, or a score of the wrong shape: no scores, and the tick is still accepted.
    assert check_tick_scores({"score": np.zeros(2)}, spec) is None
    assert check_tick_scores({"other": np.zeros(n)}, spec) is None


def check_tick_scores(infos: dict[str, np.ndarray], spec: LinkSpec) -> Any:
    n = spec.num_agents
    batch = game_link_pb2.ObservationBatch(
        tick=1,
        observations=tensor.encode_tree(np.zeros((n, 2), np.float32)),
        rewards=tensor.encode(np.ones(n, np.float32)),
        terminated=tensor.encode(np.ones(n, bool)),
        truncated=tensor.encode(np.zeros(n, bool)),
        episode_ids=tensor.encode(np.zeros(n, np.int64)),
        infos=tensor.encode_tree(infos),
    )
    return check_tick(batch, spec, TickCursor()).scores


# ---------------------------------------------------------------------------- helpers


def learner(window: int) -> Any:
    return bare_game_workload(episode_window=window)


def report(workload: Any) -> dict[str, float]:
    progress = SimpleNamespace(stale_dropped=0, samples=0)
    return workload.report([], {}, progress, 1.0)

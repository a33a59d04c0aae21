"""One link's transitions, recorded per agent, cut into `bus.v1.RolloutFragment`s.

A fragment is same-step-autoreset with rows [T, N], N = the link's agents, but its columns are
per-agent sequences, not ticks: at tick t agent k reports (obs_t, reward_t for its previous
action, terminated_t, truncated_t, episode id). If agent k has an open decision from its
previous tick in the same episode, the tick closes that transition with the reward and flags
(truncated: final observation obs_t, final value from this tick's policy pass). A done tick opens
no decision (its action is a throwaway the client ignores); the next tick, with a new episode id,
opens the next one on the episode's first observation. Columns thus drift apart by the done
ticks: a fragment is cut when every column has T transitions and the observation after its T-th
is known (the bootstrap); faster columns keep their extra transitions for the next fragment.

A fragment's policy_version is the oldest version among its actions (the link swaps weights at
any tick, not between fragments). Episode ids in fragments are numbered by the server per link
(unique across its agents), not the client's.

`end_episodes` ends every open episode as truncated at its last complete transition (a link that
broke and did not continue, or said Goodbye), and so does a change of episode id without an end:
those episodes are `partial` (their statistics stay out of the run's mean return). `drain` then
turns everything buffered into fragments: repeatedly the columns that still hold transitions, cut
at the shortest one, so no complete transition is lost (those fragments are shorter and narrower
than T x N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.behaviour import Decision, action_layout
from common.fragments import FragmentArrays

__all__ = ["EpisodeEnd", "LinkRecorder", "Row"]


@dataclass
class Row:
    """One decision of one agent and, once closed, its outcome."""

    obs: np.ndarray
    action: np.ndarray
    logprob: float
    value: float
    episode: int  # server-side episode id
    version: int
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    final_obs: np.ndarray | None = None
    final_value: float = 0.0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass
class EpisodeEnd:
    """An ended episode for the statistics: (agent, return, length, truncated, score);
    `partial` when the game did not end it (the server cut it off: `_cut`), so its return is of
    a part. `score`: what the game sent as infos["score"] at the end tick, None if nothing."""

    agent: int
    episode_return: float
    length: int
    truncated: bool
    partial: bool = False
    score: float | None = None

    def as_tuple(self) -> tuple[int, float, int, bool, float | None]:
        return (self.agent, self.episode_return, self.length, self.truncated, self.score)


class _Agent:
    def __init__(self) -> None:
        self.closed: list[Row] = []  # complete transitions not in a fragment yet
        self.open: Row | None = None  # decision waiting for its reward
        self.client_episode: int | None = None  # client's id of the current episode
        self.episode = -1  # server's id of it
        self.episode_return = 0.0
        self.length = 0
        self.in_episode = False


class LinkRecorder:
    """Per-agent columns of one link; `record` once per answered tick, in tick order."""

    def __init__(
        self,
        num_agents: int,
        observation_space: Any,
        action_space: Any,
        rollout_length: int,
        *,
        has_values: bool,
    ) -> None:
        self.num_agents = num_agents
        self.has_values = has_values
        self.T = rollout_length
        self.obs_shape = tuple(observation_space.shape)
        self.obs_dtype = observation_space.dtype
        self.act_shape, self.act_dtype = action_layout(action_space)
        self.agents = [_Agent() for _ in range(num_agents)]
        self._next_episode = 0
        self.transitions = 0  # closed over the link's life
        self.episodes = 0  # ended over the link's life
        self.ticks = 0  # answered over the link's life
        self.last_tick = 0  # of the last answered batch (0: none)
        self.last_done: np.ndarray | None = None  # per agent, at the last answered tick
        self.last_episode_ids: np.ndarray | None = None

    def record(self, tick: Any, decision: Decision, version: int) -> list[EpisodeEnd]:
        """Apply one answered tick (protocol.Tick) and the policy's decision on it."""
        ended: list[EpisodeEnd] = []
        values = decision.values
        for k, agent in enumerate(self.agents):
            value = float(values[k]) if values is not None else 0.0
            eid = int(tick.episode_ids[k])
            term, trunc = bool(tick.terminated[k]), bool(tick.truncated[k])
            if agent.open is not None and eid == agent.client_episode:
                row, agent.open = agent.open, None
                row.reward = float(tick.rewards[k])
                row.terminated, row.truncated = term, trunc
                if trunc:
                    row.final_obs, row.final_value = np.array(tick.obs[k]), value
                agent.closed.append(row)
                self.transitions += 1
                agent.episode_return += row.reward
                agent.length += 1
                if term or trunc:
                    ended.append(self._end(k, agent, truncated=trunc, score=_score(tick, k)))
                    continue
            elif agent.in_episode and eid != agent.client_episode:
                # The episode changed without an end: the client lost track (a restart, a
                # resume that did not continue). End it at its last complete transition.
                end = self._cut(k, agent)
                if end is not None:
                    ended.append(end)
            if not agent.in_episode:
                if term or trunc:
                    continue  # an episode that ends at its first observation has no step
                agent.in_episode = True
                agent.client_episode = eid
                agent.episode = self._next_episode
                self._next_episode += 1
                agent.episode_return, agent.length = 0.0, 0
            agent.open = Row(
                obs=np.array(tick.obs[k]),
                action=np.array(decision.actions[k]),
                logprob=float(decision.logprobs[k]),
                value=value,
                episode=agent.episode,
                version=version,
            )
        self.ticks += 1
        self.last_tick = tick.tick
        self.last_done, self.last_episode_ids = tick.done, tick.episode_ids
        self.episodes += len(ended)
        return ended

    def _end(
        self, k: int, agent: _Agent, *, truncated: bool, score: float | None = None
    ) -> EpisodeEnd:
        agent.in_episode = False
        return EpisodeEnd(k, agent.episode_return, agent.length, truncated, score=score)

    def _cut(self, k: int, agent: _Agent) -> EpisodeEnd | None:
        """End agent k's open episode as truncated at its last complete transition, whose
        final observation is the one of the dropped open decision (the last answered)."""
        row, agent.open = agent.open, None
        if row is not None and agent.closed and agent.closed[-1].episode == row.episode:
            last = agent.closed[-1]
            last.truncated, last.final_obs, last.final_value = True, row.obs, row.value
        # (A last transition already in a fragment was followed there by row's observation and
        # bootstrapped from its value: the same as a truncation with that final observation.)
        agent.in_episode = False
        if agent.length == 0:
            return None
        return EpisodeEnd(k, agent.episode_return, agent.length, True, partial=True)

    def end_episodes(self) -> list[EpisodeEnd]:
        """End every open episode (see the module docstring)."""
        ended = [self._cut(k, a) for k, a in enumerate(self.agents) if a.in_episode]
        out = [e for e in ended if e is not None]
        self.episodes += len(out)
        return out

    # ------------------------------------------------------------------ fragments

    def ready(self) -> bool:
        """Every column has T transitions and the observation after the T-th."""
        T = self.T
        return all(
            len(a.closed) > T or (len(a.closed) == T and a.open is not None) for a in self.agents
        )

    def cut(self) -> tuple[FragmentArrays, int]:
        """The next full fragment (T x N) and its policy version; call when `ready`."""
        columns = []
        for a in self.agents:
            rows, a.closed = a.closed[: self.T], a.closed[self.T :]
            after = a.closed[0] if a.closed else a.open
            assert after is not None
            columns.append((rows, after.obs, after.value))
        return self._arrays(columns)

    def drain(self) -> list[tuple[FragmentArrays, int]]:
        """Everything buffered as fragments (after end_episodes: every column ends done)."""
        out: list[tuple[FragmentArrays, int]] = []
        while True:
            agents = [a for a in self.agents if a.closed]
            if not agents:
                return out
            t = min(len(a.closed) for a in agents)
            columns = []
            for a in agents:
                rows, a.closed = a.closed[:t], a.closed[t:]
                if a.closed:
                    after = a.closed[0]
                    columns.append((rows, after.obs, after.value))
                else:  # ends done: the next observation only matters for a bootstrap
                    last = rows[-1]
                    obs = last.final_obs if last.final_obs is not None else last.obs
                    columns.append((rows, obs, 0.0))
            out.append(self._arrays(columns))

    def buffered(self) -> int:
        return sum(len(a.closed) for a in self.agents)

    def _arrays(
        self, columns: list[tuple[list[Row], np.ndarray, float]]
    ) -> tuple[FragmentArrays, int]:
        t, n = len(columns[0][0]), len(columns)
        obs = np.empty((t, n, *self.obs_shape), self.obs_dtype)
        actions = np.empty((t, n, *self.act_shape), self.act_dtype)
        logprobs = np.empty((t, n), np.float32)
        values = np.empty((t, n), np.float32)
        rewards = np.empty((t, n), np.float32)
        terminated = np.zeros((t, n), bool)
        truncated = np.zeros((t, n), bool)
        episode_ids = np.empty((t, n), np.int64)
        next_obs = np.empty((n, *self.obs_shape), self.obs_dtype)
        bootstrap = np.empty(n, np.float32)
        finals: list[tuple[int, np.ndarray, float]] = []
        version = None
        for j, (rows, after_obs, after_value) in enumerate(columns):
            next_obs[j], bootstrap[j] = after_obs, after_value
            for i, row in enumerate(rows):
                obs[i, j], actions[i, j] = row.obs, row.action
                logprobs[i, j], values[i, j], rewards[i, j] = row.logprob, row.value, row.reward
                terminated[i, j], truncated[i, j] = row.terminated, row.truncated
                episode_ids[i, j] = row.episode
                if row.truncated and not row.terminated:
                    assert row.final_obs is not None
                    finals.append((i * n + j, row.final_obs, row.final_value))
                version = row.version if version is None else min(version, row.version)
        finals.sort(key=lambda f: f[0])
        arrays = FragmentArrays(
            observations=obs,
            actions=actions,
            logprobs=logprobs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            next_observations=next_obs,
            episode_ids=episode_ids,
            values=values if self.has_values else None,
            bootstrap_values=bootstrap if self.has_values else None,
        )
        if finals:
            arrays.final_indices = np.array([f[0] for f in finals], np.int64)
            arrays.final_observations = np.stack([f[1] for f in finals])
            if self.has_values:
                arrays.final_values = np.array([f[2] for f in finals], np.float32)
        return arrays, int(version or 0)


def _score(tick: Any, k: int) -> float | None:
    """Agent k's score at this (end) tick, None when the game sent none (NaN in Tick.scores)."""
    scores = tick.scores
    if scores is None or np.isnan(scores[k]):
        return None
    return float(scores[k])

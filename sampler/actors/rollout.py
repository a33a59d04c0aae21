"""The fragment being filled: preallocated [T, N] buffers and their RolloutFragment form.

One `Rollout` lives as long as the actor. Each tick writes one row t of every buffer (numpy
slice assignments, no loop over envs); after T ticks `build` turns the rows into a
`bus.v1.RolloutFragment` and `restart` carries the last observation over as the next
fragment's first. Observations take T + 1 rows so that the env's answer at tick t lands
directly in row t + 1 and row T is next_observations: nothing is copied per tick.

A double-buffered actor (sampler/actors/sampling.py) fills the columns in parts, each part
(a contiguous range of env columns) at its own row: `record`/`finish` take the part, and a part
that has its T rows waits for the others before the fragment is built. Every column's steps stay
consecutive, so the fragment is the same [T, N] layout as from lock-step ticks.

Episode ids are numbered per actor incarnation: env n starts in episode n, and every episode
end (terminated, truncated, or a dropped env session) gives that env the next free id, so ids
increase along each env's timeline and never repeat across envs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.behaviour import Behaviour, Decision, action_layout
from common.fragments import FragmentArrays, FragmentMeta, build_fragment, fragment_id
from rlfleet.bus.v1 import trajectory_pb2
from sampler.actors.envs import StepOut, TickEvents

__all__ = ["FragmentMeta", "Rollout", "fragment_id"]


class Rollout:
    """Rows of the current fragment, for N envs and T steps."""

    def __init__(
        self,
        num_steps: int,
        num_envs: int,
        observation_space: Any,
        action_space: Any,
        *,
        has_values: bool,
        parts: list[slice] | None = None,
    ) -> None:
        t, n = num_steps, num_envs
        self.parts = parts or [slice(0, n)]  # contiguous column ranges, each at its own row
        self.num_steps, self.num_envs = t, n
        act_shape, act_dtype = action_layout(action_space)
        obs_shape, obs_dtype = tuple(observation_space.shape), observation_space.dtype
        self.obs = np.zeros((t + 1, n, *obs_shape), obs_dtype)  # row T: next_observations
        self.actions = np.zeros((t, n, *act_shape), act_dtype)
        self.logprobs = np.zeros((t, n), np.float32)
        self.values = np.zeros((t, n), np.float32) if has_values else None
        self.rewards = np.zeros((t, n), np.float32)
        self.terminated = np.zeros((t, n), bool)
        self.truncated = np.zeros((t, n), bool)
        self.episode_ids = np.zeros((t, n), np.int64)
        self._outs = [
            StepOut(self.obs[i + 1], self.rewards[i], self.terminated[i], self.truncated[i])
            for i in range(t)
        ]
        self._final_index: list[np.ndarray] = []  # flat t * N + n, per tick that had any
        self._final_obs: list[np.ndarray] = []
        self.episode = np.arange(n, dtype=np.int64)  # current episode id of each env
        self._next_episode = n
        self._rows = [0] * len(self.parts)  # the row each part fills next
        self.sequence = 0  # of the next fragment

    @property
    def nbytes(self) -> int:
        """Size of a fragment's arrays (finals aside): about its size on the wire."""
        arrays = (self.obs, self.actions, self.logprobs, self.values, self.rewards)
        flags = (self.terminated, self.truncated, self.episode_ids)
        return sum(a.nbytes for a in (*arrays, *flags) if a is not None)

    @property
    def t(self) -> int:
        """The row part 0 fills next (in lock step: every part's)."""
        return self._rows[0]

    @property
    def full(self) -> bool:
        return all(row == self.num_steps for row in self._rows)

    def part_full(self, part: int) -> bool:
        return self._rows[part] == self.num_steps

    @property
    def current_obs(self) -> np.ndarray:
        """Observations the next decision is made on, [N, ...] (one part: `row_obs`)."""
        return self.obs[self._rows[0]]

    def row_obs(self, part: int) -> np.ndarray:
        """The whole row [N, ...] that `part` acts on next; its columns are the part's."""
        return self.obs[self._rows[part]]

    def begin(self, first_obs: np.ndarray) -> None:
        """Start the first fragment from the envs' reset observations."""
        self.obs[0] = first_obs
        self._rows = [0] * len(self.parts)

    def record(self, decision: Decision, part: int = 0) -> StepOut:
        """Store the part's decision at its row; return the row the env step must fill (the
        whole row: a part's env step writes only its columns)."""
        t, cols = self._rows[part], self.parts[part]
        self.actions[t, cols] = decision.actions
        self.logprobs[t, cols] = decision.logprobs
        if self.values is not None and decision.values is not None:
            self.values[t, cols] = decision.values
        self.episode_ids[t, cols] = self.episode[cols]
        return self._outs[t]

    def finish(self, events: TickEvents, part: int = 0) -> None:
        """Close the part's row once its env columns are written: finals, new episode ids, and
        the part moves on a row. `events` carry global env indices."""
        t, n, cols = self._rows[part], self.num_envs, self.parts[part]
        for index, rows in zip(events.final_indices, events.final_obs, strict=True):
            self._final_index.append(t * n + index)
            self._final_obs.append(rows)
        done = self.terminated[t, cols] | self.truncated[t, cols]
        if done.any():
            ended = np.flatnonzero(done) + (cols.start or 0)
            self.episode[ended] = self._next_episode + np.arange(ended.size)
            self._next_episode += ended.size
        self._rows[part] = t + 1

    def build(self, policy: Behaviour, meta: FragmentMeta) -> trajectory_pb2.RolloutFragment:
        """The full fragment as a message (arrays copied into it: the buffers are free after)."""
        if not self.full:
            raise RuntimeError(f"fragment has {min(self._rows)} of {self.num_steps} steps")
        final_index = final_obs = final_values = None
        if self._final_index:
            index = np.concatenate(self._final_index)
            order = np.argsort(index, kind="stable")
            final_index = index[order].astype(np.int64)
            final_obs = np.concatenate(self._final_obs)[order]
            if self.values is not None:
                final_values = policy.values(final_obs)
        next_obs = self.obs[self.num_steps]
        arrays = FragmentArrays(
            observations=self.obs[: self.num_steps],
            actions=self.actions,
            logprobs=self.logprobs,
            rewards=self.rewards,
            terminated=self.terminated,
            truncated=self.truncated,
            next_observations=next_obs,
            episode_ids=self.episode_ids,
            values=self.values,
            bootstrap_values=policy.values(next_obs) if self.values is not None else None,
            final_indices=final_index,
            final_observations=final_obs,
            final_values=final_values,
        )
        return build_fragment(meta, self.sequence, policy.version, arrays)

    def restart(self) -> None:
        """Begin the next fragment where this one ended."""
        self.obs[0] = self.obs[self.num_steps]
        self._final_index.clear()
        self._final_obs.clear()
        self._rows = [0] * len(self.parts)
        self.sequence += 1

# A tiny gymnasium environment defined in a plain file, for examples/ppo_custom_env.yaml.
#
# The run file names it as `env_id: examples/custom_env.py:Corridor` (a path relative to the
# directory `rlfleet` runs from, then the class): `rlfleet validate` imports this file and checks
# that Corridor is a gymnasium.Env subclass, and each env server imports it again at its start
# and registers the reference as an env id it creates (kwargs from `env_kwargs` reach __init__).
# Nothing needs installing. A function returning an Env works too (`custom_env.py:make`).
"""Corridor: walk right to the exit; every step costs a little, the exit pays 1."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Corridor(gym.Env[np.ndarray, np.int64]):
    """A corridor of ``length`` cells, start at cell 0: action 1 moves right, 0 moves left.

    Observation: the position scaled to [0, 1]. Reward: -0.01 per step, +1 on reaching the last
    cell (terminated); truncated after ``max_steps`` steps. A trained policy always moves right
    (return 1 - 0.01 * (length - 2)); a random one rarely gets out in time.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, length: int = 8, max_steps: int = 50, render_mode: str | None = None):
        if length < 2:
            raise ValueError(f"length must be >= 2, got {length}")
        self.length, self.max_steps, self.render_mode = length, max_steps, render_mode
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._pos = self._steps = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._pos / (self.length - 1)], np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._pos = self._steps = 0
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        self._pos = min(max(self._pos + (1 if int(action) == 1 else -1), 0), self.length - 1)
        terminated = self._pos == self.length - 1
        reward = 1.0 if terminated else -0.01
        return self._obs(), reward, terminated, self._steps >= self.max_steps, {}

    def render(self) -> str:
        return "".join("A" if i == self._pos else "." for i in range(self.length))


def make(**kwargs: Any) -> Corridor:
    """The same env through a factory: `env_id: examples/custom_env.py:make`."""
    return Corridor(**kwargs)

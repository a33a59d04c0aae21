"""Envs named by reference in the tests (``tests.plugins.envs_plugin:Name``): a class, a factory,
a factory returning something else, a non-Env class, a slow env, and a gymnasium id registered on
import."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

REGISTERED_ID = "RlfleetTestsCoin-v0"


class Coin(gym.Env):
    """One step: observation ``value``, reward 1 for action 1."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, value: float = 0.5, render_mode: str | None = None) -> None:
        self.value, self.render_mode = value, render_mode

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.full(1, self.value, np.float32), {}

    def step(self, action: Any):
        return np.full(1, self.value, np.float32), float(action), True, False, {}


def make_coin(**kwargs: Any) -> Coin:
    return Coin(**kwargs)


def make_nothing(**kwargs: Any) -> int:
    return 0


class NotAnEnv:
    pass


NUMBER = 3

if REGISTERED_ID not in gym.registry:
    gym.register(REGISTERED_ID, entry_point=make_coin, max_episode_steps=7)


class Slow(gym.Env):
    """Each step takes `delay_s` of wall time without CPU (a simulator elsewhere, a game
    process): what lets a test see the actor's double buffering overlap steps and inference."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, delay_s: float = 0.001) -> None:
        self.delay_s = delay_s

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any):
        time.sleep(self.delay_s)
        return np.zeros(1, np.float32), 0.0, False, False, {}

"""Environments that cost real time per step, as a simulator does, for scaling benchmarks.

CartPole's step is microseconds of Python, so adding env servers cannot show on a machine
whose cores the actors and the learner already fill. `SlowCartPole` holds its server's event
loop for `step_ms` per env step (a sleep, so it uses no core): one env server then steps at
most 1000 / step_ms env steps a second, and replicas add capacity the way servers of a real
simulator would on cores or machines of their own.
"""

from __future__ import annotations

import time
from typing import Any

from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.wrappers import TimeLimit


class SlowCartPole(TimeLimit):
    """CartPole-v1 (episodes of at most 500 steps) whose every step takes ``step_ms``."""

    def __init__(self, step_ms: float = 4.0, **kwargs: Any) -> None:
        super().__init__(CartPoleEnv(**kwargs), max_episode_steps=500)
        self.step_s = step_ms / 1000.0

    def step(self, action: Any) -> Any:
        time.sleep(self.step_s)
        return super().step(action)

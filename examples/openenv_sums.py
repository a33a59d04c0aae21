# An environment written for OpenEnv (openenv-core's Environment, Action and Observation models),
# trained by examples/agent_openenv.yaml through rlfleet's adapter: the run file names it as
# `env: {env_id: OpenEnvText-v0, kwargs: {env: examples/openenv_sums.py:SumsEnvironment}}`
# (docs/text_envs.md). The same class serves over OpenEnv's own HTTP server unchanged.
"""Sums: a few sums in a row; each right answer pays, a wrong one ends the episode."""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class SumsAction(Action):
    """The agent's answer, as text."""

    answer: str = Field(..., description="the sum, as digits")


class SumsObservation(Observation):
    """The next question (empty once the episode is done)."""

    question: str = Field(default="", description="what to add up")


class SumsEnvironment(Environment[SumsAction, SumsObservation, State]):
    """``rounds`` questions "a+b=" with operands below ``high``; 1 / rounds per right answer."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, rounds: int = 3, high: int = 10) -> None:
        super().__init__()
        if rounds < 1 or high < 2:
            raise ValueError(f"rounds must be >= 1 and high >= 2, got {rounds}, {high}")
        self.rounds, self.high = rounds, high
        self.rng = random.Random()
        self._state = State(episode_id=None, step_count=0)
        self._terms = (0, 0)

    def _ask(self, reward: float | None = None) -> SumsObservation:
        self._terms = (self.rng.randrange(self.high), self.rng.randrange(self.high))
        a, b = self._terms
        return SumsObservation(question=f"{a}+{b}=", reward=reward)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> SumsObservation:
        self.rng = random.Random(seed)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return self._ask()

    def step(
        self, action: SumsAction, timeout_s: float | None = None, **kwargs: Any
    ) -> SumsObservation:
        self._state.step_count += 1
        digits = "".join(c for c in action.answer if c.isdigit())
        right = digits == str(sum(self._terms))
        if not right:
            return SumsObservation(done=True, reward=0.0, metadata={"outcome": "wrong"})
        if self._state.step_count >= self.rounds:
            return SumsObservation(
                done=True, reward=1.0 / self.rounds, metadata={"outcome": "all_right"}
            )
        return self._ask(reward=1.0 / self.rounds)

    @property
    def state(self) -> State:
        return self._state


def expert_answer(observation: SumsObservation) -> str:
    """The right answer to the latest question: the adapter's ``expert`` (not part of OpenEnv),
    which gives the learner demonstrations for its SFT warm start."""
    a, _, b = observation.question.removesuffix("=").partition("+")
    return str(int(a) + int(b))

"""``GymnasiumText-v0``: any gymnasium env with a text rendering, played in chat messages.

The env is made with ``render_mode="ansi"``; each turn shows its rendering as the user's message
(terminal highlights, such as FrozenLake's mark on the agent's cell, become ``[x]``), and the
model answers with an action of its Discrete action space: its number, or one of
``action_names`` when given. A reply that names no action is told so and costs the turn.
Episodes follow the env's own termination and time limit, and end truncated after ``max_turns``
turns (twice the env's step limit by default), replies that named no action included.
"""

from __future__ import annotations

import re
from typing import Any

from env_server.text.base import Message, TextEnv, TextStep, check_split, split_of

__all__ = ["GymnasiumText", "plain_text"]

_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m(.*?)\x1b\[0m", re.S)
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WORD = re.compile(r"[A-Za-z_]+|-?\d+")


def plain_text(rendering: str) -> str:
    """A terminal rendering as plain text: highlighted spans bracketed, other escapes dropped."""
    return _ESCAPE.sub("", _HIGHLIGHT.sub(r"[\1]", rendering)).strip("\n")


class GymnasiumText(TextEnv):
    """A gymnasium env with ``render_mode="ansi"`` and a Discrete action space, in messages.

    ``split`` draws the episodes' seeds from disjoint sets (an env's task is its seed).
    """

    def __init__(
        self,
        env_id: str,
        split: str = "train",
        action_names: list[str] | None = None,
        env_kwargs: dict[str, Any] | None = None,
        max_turns: int | None = None,
    ) -> None:
        import gymnasium

        super().__init__()
        self.split = check_split(split)
        self.env_id = env_id
        self.env = gymnasium.make(env_id, render_mode="ansi", **(env_kwargs or {}))
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            self.env.close()
            raise ValueError(f"{env_id} has a {type(space).__name__} action space, not Discrete")
        self.first_action, self.actions = int(space.start), int(space.n)
        if action_names is not None and len(action_names) != self.actions:
            self.env.close()
            raise ValueError(f"{env_id} has {self.actions} actions, got {len(action_names)} names")
        self.action_names = [n.lower() for n in action_names] if action_names else None
        # Turns, replies that name no action included: a model that never names one is cut off.
        steps = self.env.spec.max_episode_steps if self.env.spec else None
        self.max_turns = max_turns or 2 * (steps or 100)
        self.turns = 0

    def _choices(self) -> str:
        numbers = range(self.first_action, self.first_action + self.actions)
        if self.action_names is None:
            return ", ".join(str(n) for n in numbers)
        return ", ".join(
            f"{n} ({name})" for n, name in zip(numbers, self.action_names, strict=True)
        )

    def _observation(self) -> Message:
        return {"role": "user", "content": plain_text(str(self.env.render()))}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        while split_of((self.env_id, task := self.rng.randrange(2**31))) != self.split:
            pass
        self.task, self.turns = task, 0
        _, info = self.env.reset(seed=task, options=options)
        system = {
            "role": "system",
            "content": f"You are playing {self.env_id}. Each turn, answer with one action: "
            f"{self._choices()}.",
        }
        return [system, self._observation()], _numbers(info)

    def _action(self, content: str) -> int | None:
        for word in reversed(_WORD.findall(content)):
            if self.action_names is not None and word.lower() in self.action_names:
                return self.first_action + self.action_names.index(word.lower())
            if word.lstrip("-").isdigit():
                number = int(word)
                if self.first_action <= number < self.first_action + self.actions:
                    return number
                return None
        return None

    def step(self, message: Message) -> TextStep:
        self.turns += 1
        action = self._action(message.get("content") or "")
        if action is None:
            if self.turns >= self.max_turns:
                return [], 0.0, False, True, {"outcome": "max_turns"}
            reply = {"role": "user", "content": f"Not an action. Choose one of {self._choices()}."}
            return [reply], 0.0, False, False, {"outcome": "no_action"}
        _, reward, terminated, truncated, info = self.env.step(action)
        truncated = truncated or self.turns >= self.max_turns
        messages = [] if terminated or truncated else [self._observation()]
        return messages, float(reward), bool(terminated), bool(truncated), _numbers(info)

    def close(self) -> None:
        self.env.close()


def _numbers(info: dict[str, Any]) -> dict[str, Any]:
    """The plain values of a gymnasium info dict (arrays and objects are left out)."""
    return {k: v for k, v in info.items() if isinstance(v, bool | int | float | str)}

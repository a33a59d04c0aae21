# A text environment defined in a plain file, for examples/agent_custom_env.yaml.
#
# The run file names it as `env_id: examples/custom_text_env.py:RunningTotal` (a path relative
# to the directory `rlfleet` runs from, then the class): each env server imports this file at
# its start and registers the reference as a text env id (docs/text_envs.md). Nothing needs
# installing. `expert_reply` gives the learner demonstrations for its SFT warm start, and
# `split` keeps evaluation episodes apart from training ones.
"""RunningTotal: keep a running total over several turns; the total is never said again."""

from __future__ import annotations

from typing import Any

from env_server.text import TextEnv
from env_server.text.base import Message, TextStep, check_split, split_of


class RunningTotal(TextEnv):
    """The user gives a start value, then one number to add per turn; the model answers each
    turn with the new total. Each right total pays 1 / ``rounds``; a wrong one ends the episode
    (terminated). The model must remember the total: only the numbers added are said."""

    def __init__(self, split: str = "train", rounds: int = 3, high: int = 10) -> None:
        super().__init__()
        self.split = check_split(split)
        if rounds < 1 or high < 2:
            raise ValueError(f"rounds must be >= 1 and high >= 2, got {rounds}, {high}")
        self.rounds, self.high = rounds, high
        self.total = self.turns = 0
        self.addends: list[int] = []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        while True:
            start = self.rng.randrange(self.high)
            addends = [self.rng.randrange(1, self.high) for _ in range(self.rounds)]
            self.task = (start, tuple(addends))
            if split_of(self.task) == self.split:
                break
        self.total, self.addends, self.turns = start, addends, 0
        self.total += self.addends[0]
        opening = f"Start at {start}. Add {self.addends[0]}. Total?"
        return [{"role": "user", "content": opening}], {"rounds": self.rounds}

    def step(self, message: Message) -> TextStep:
        self.turns += 1
        said = "".join(c for c in message.get("content") or "" if c.isdigit())
        if said != str(self.total):
            return [], 0.0, True, False, {"outcome": "wrong", "turns": self.turns}
        reward = 1.0 / self.rounds
        if self.turns == self.rounds:
            return [], reward, True, False, {"outcome": "all_right", "turns": self.turns}
        self.total += self.addends[self.turns]
        ask = {"role": "user", "content": f"Add {self.addends[self.turns]}. Total?"}
        return [ask], reward, False, False, {"turns": self.turns}

    def expert_reply(self) -> Message:
        return {"role": "assistant", "content": str(self.total)}

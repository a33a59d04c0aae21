"""`TextEnv`: a multi-turn environment whose observations and actions are chat messages.

Gymnasium's shape with messages in place of tensors: ``reset(seed=, options=)`` returns the
messages that open an episode (system prompt, first user turn) and an info dict; ``step(message)``
takes the model's assistant message and returns the messages the environment answers with (tool
results, the next user turn), a reward, ``terminated``, ``truncated`` and an info dict. The
episode's state lives in the environment object, on the env server: a client only ever sends the
model's turn.

Messages are OpenAI chat messages as plain dicts (``{"role", "content"}``, plus ``tool_calls``
on assistant messages and ``tool_call_id`` / ``name`` on tool messages), the form chat templates
render. `tools` lists the functions an environment offers in OpenAI's tool schema, rendered into
the prompt by the model's chat template.

Every built-in environment takes ``split`` ("train" or "eval"): the two draw their tasks from
disjoint sets, so evaluation is held out.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from clients.env.types import Message
from services.errors import FailedPrecondition

__all__ = ["SPLITS", "Message", "TextEnv", "TextStep", "check_split", "play_expert", "split_of"]

# (messages, reward, terminated, truncated, info): what `TextEnv.step` returns.
TextStep = tuple[list[Message], float, bool, bool, dict[str, Any]]

SPLITS = ("train", "eval")
MAX_EXPERT_TURNS = 64  # an expert that never ends its episode is cut off here
# One task in this many falls in the eval split (by a hash of the task, see `split_of`).
_EVAL_ONE_IN = 8


class TextEnv:
    """Base class of text environments (subclass it; override `reset` and `step`)."""

    # OpenAI function tools the environment offers (the same for every episode), e.g.
    # {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}.
    # Usually a class attribute; an env whose offer depends on its arguments sets its own.
    tools: list[dict[str, Any]] = []
    metadata: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.rng = random.Random()
        self.task: Any = None  # the episode's task (what the split is drawn on), once reset

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode; reseeds `rng` when ``seed`` is given (as gymnasium does)."""
        if seed is not None:
            self.rng = random.Random(seed)
        return [], {}

    def step(self, message: Message) -> TextStep:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def expert_reply(self) -> Message | None:
        """What an expert would say now, mid-episode: demonstrations for a supervised warm start
        (the pool plays them, see `TextPool.reset`'s ``demonstrate`` option). None: this
        environment has no expert."""
        return None

    def close(self) -> None:
        """Free what the environment holds (processes, sockets); called once."""


def play_expert(env: TextEnv) -> tuple[list[Message], float]:
    """The rest of ``env``'s episode played by its expert: what the expert and the env said, in
    order, and the rewards summed. FailedPrecondition when the env has no expert."""
    said: list[Message] = []
    total = 0.0
    for _ in range(MAX_EXPERT_TURNS):
        reply = env.expert_reply()
        if reply is None:
            raise FailedPrecondition(f"{type(env).__name__} has no expert to demonstrate")
        messages, reward, terminated, truncated, _ = env.step(reply)
        said += [reply, *messages]
        total += float(reward)
        if terminated or truncated:
            return said, total
    raise ValueError(f"the expert did not end its episode in {MAX_EXPERT_TURNS} turns")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split


def split_of(task: object) -> str:
    """The split a task belongs to, from a stable hash of its repr (not Python's salted hash),
    so train and eval never share a task whatever the seeds."""
    digest = 0
    for byte in repr(task).encode():
        digest = (digest * 131 + byte) % 1_000_003
    return "eval" if digest % _EVAL_ONE_IN == 0 else "train"

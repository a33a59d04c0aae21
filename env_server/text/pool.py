"""`TextPool`: N text environments of one id, reset and stepped by the messages of a session.

Unlike a tensor pool, text envs move at their own pace (episodes end after different numbers of
turns), so a step names the envs it steps, one assistant message each, and an env is reset only
when the client asks (autoreset DISABLED). An env's step runs in a thread of its own under
``step_timeout_s``: an env that hangs or raises ends its episode (truncated, with the outcome in
its info) instead of the session, and is replaced by a fresh one at its next reset; the others'
steps are answered as usual.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from clients.env.text import DEMONSTRATE
from clients.env.types import EpisodeStats, Message, TextStepResult, TextTurn
from env_server.pool import check_seeds, env_indices
from env_server.text.base import TextEnv, play_expert
from env_server.text.tools import ThreadCall
from services.errors import FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["TextPool"]

log = logging.getLogger(__name__)

_ROLES_IN = ("assistant",)  # what a client may send: the model's turn
_ROLES_OUT = ("system", "user", "assistant", "tool")  # what an env may answer with
_NEW, _RUNNING, _ENDED, _BROKEN = "new", "running", "ended", "broken"


class TextPool:
    """``num_envs`` text envs made by ``make_env()`` (see the module docstring)."""

    def __init__(
        self,
        make_env: Callable[[], TextEnv],
        num_envs: int,
        *,
        seed: int | None = None,
        step_timeout_s: float = 30.0,
        max_message_chars: int = 65536,
    ) -> None:
        self.make_env = make_env
        self.envs: list[TextEnv] = []
        try:
            for _ in range(num_envs):
                self.envs.append(self._made())
        except BaseException:
            self.close()
            raise
        self.num_envs = num_envs
        self.tools: list[dict[str, Any]] = list(self.envs[0].tools)
        self.metadata: dict[str, Any] = dict(type(self.envs[0]).metadata)
        self.step_timeout_s = step_timeout_s
        self.max_message_chars = max_message_chars
        self._first_seed = seed
        self._state = [_NEW] * num_envs
        self._returns = [0.0] * num_envs
        self._lengths = [0] * num_envs
        self.total_steps = 0

    def _made(self) -> TextEnv:
        env = self.make_env()
        if not isinstance(env, TextEnv):
            made = type(env).__name__
            raise FailedPrecondition(f"the env factory returned {made}, not a TextEnv")
        return env

    def reset(
        self,
        *,
        seed: int | None = None,
        seeds: Sequence[int | None] | None = None,
        indices: Sequence[int] = (),
        options: dict[str, Any] | None = None,
    ) -> list[TextTurn]:
        """Reset ``indices`` (all when empty); env i gets seed + i, or the k-th its ``seeds[k]``.
        The first reset without a seed uses the pool's. Options an env rejects are
        InvalidArgument; an env that hangs past ``step_timeout_s`` is Unavailable.

        Option ``demonstrate: true``: each env's expert plays the episode to its end at once
        (`TextEnv.expert_reply`, stepped as a client would); the info holds its turns under
        ``demonstration`` (the expert's messages and the env's answers, in order) and their
        rewards' sum under ``demonstration_return``, and the env is left ended."""
        options = dict(options or {})
        demonstrate = bool(options.pop(DEMONSTRATE, False))
        targets = env_indices(indices, self.num_envs, "reset.env_indices") or list(
            range(self.num_envs)
        )
        check_seeds(seed, seeds, len(targets))
        if seeds is None:
            if seed is None and self._first_seed is not None:
                seed = self._first_seed
            seeds = [None if seed is None else seed + i for i in targets]
        self._first_seed = None
        turns = []
        for i, env_seed in zip(targets, seeds, strict=True):
            if self._state[i] == _BROKEN:
                self._replace(i)
            env = self.envs[i]
            reset = functools.partial(env.reset, seed=env_seed, options=options or None)
            call = ThreadCall(reset)
            outcome, value = call.outcome(time.monotonic() + self.step_timeout_s)
            if outcome == "timeout":
                self._state[i] = _BROKEN
                raise Unavailable(
                    f"env {i} did not reset within {self.step_timeout_s:g}s (step_timeout_s); "
                    "it is replaced at its next reset",
                    field="reset",
                )
            if outcome == "error":
                self._state[i] = _BROKEN
                if options and isinstance(value, ValueError | TypeError | AssertionError):
                    raise InvalidArgument(
                        f"env {i} rejected the reset options: {type(value).__name__}: {value}",
                        field="reset.options",
                    ) from value
                raise value
            messages, info = self._checked_reset(i, value)
            self._state[i] = _RUNNING
            self._returns[i], self._lengths[i] = 0.0, 0
            if demonstrate:
                info.update(self._demonstration(i))
            turns.append(TextTurn(i, messages, info))
        return turns

    def _demonstration(self, i: int) -> dict[str, Any]:
        """Env i's episode played by its expert, under one ``step_timeout_s`` for the whole."""
        outcome, value = ThreadCall(functools.partial(play_expert, self.envs[i])).outcome(
            time.monotonic() + self.step_timeout_s
        )
        self._state[i] = _ENDED if outcome == "ok" else _BROKEN
        if outcome == "timeout":
            raise Unavailable(
                f"env {i}'s expert did not finish within {self.step_timeout_s:g}s (step_timeout_s)",
                field="reset.options.demonstrate",
            )
        if outcome == "error":
            if isinstance(value, FailedPrecondition):
                raise value
            raise FailedPrecondition(
                f"env {i}'s demonstration failed: {type(value).__name__}: {value}",
                field="reset.options.demonstrate",
            ) from value
        said, total = value
        return {"demonstration": _messages(said, i, "expert_reply"), "demonstration_return": total}

    def step(self, indices: Sequence[int], messages: Sequence[Message]) -> TextStepResult:
        """Step the envs ``indices`` (all when empty) with one assistant message each. Every
        check comes before any env is stepped: a bad request steps nothing."""
        targets = env_indices(indices, self.num_envs, "step.env_indices") or list(
            range(self.num_envs)
        )
        if len(messages) != len(targets):
            raise InvalidArgument(
                f"{len(messages)} text actions for {len(targets)} envs (one assistant message "
                "each)",
                field="step.text_actions",
            )
        for k, (i, message) in enumerate(zip(targets, messages, strict=True)):
            self._check_action(i, k, message)
        calls = [
            ThreadCall(functools.partial(self.envs[i].step, message))
            for i, message in zip(targets, messages, strict=True)
        ]
        deadline = time.monotonic() + self.step_timeout_s  # one deadline: the steps run at once
        results = [call.outcome(deadline) for call in calls]
        out = TextStepResult(targets, [], [], [], [])
        for i, (outcome, value) in zip(targets, results, strict=True):
            reward, terminated, truncated, turn = self._settle(i, outcome, value)
            out.rewards.append(reward)
            out.terminated.append(terminated)
            out.truncated.append(truncated)
            out.turns.append(turn)
            self._returns[i] += reward
            self._lengths[i] += 1
            self.total_steps += 1
            if terminated or truncated:
                if self._state[i] != _BROKEN:
                    self._state[i] = _ENDED
                score = turn.info.get("score")
                out.episodes.append(
                    EpisodeStats(
                        i,
                        self._returns[i],
                        self._lengths[i],
                        truncated and not terminated,
                        float(score) if isinstance(score, int | float) else None,
                    )
                )
        return out

    def _settle(self, i: int, outcome: str, value: Any) -> tuple[float, bool, bool, TextTurn]:
        """(reward, terminated, truncated, turn) of env i's step; a step that hung, raised or
        returned something malformed truncates the episode with the outcome in its info."""
        if outcome == "ok":
            try:
                return self._checked_step(i, value)
            except ValueError as exc:
                outcome, value = "error", exc
        self._state[i] = _BROKEN
        if outcome == "timeout":
            info = {"outcome": "step_timeout", "step_timeout_s": self.step_timeout_s}
            log.warning("text env %d: no step answer within %gs", i, self.step_timeout_s)
        else:
            info = {"outcome": "env_error", "error": f"{type(value).__name__}: {value}"}
            log.warning("text env %d raised in step: %s", i, info["error"], exc_info=value)
        return 0.0, False, True, TextTurn(i, [], info)

    def _check_action(self, i: int, k: int, message: Message) -> None:
        state = self._state[i]
        if state != _RUNNING:
            why = {
                _NEW: "before its first reset",
                _ENDED: "after its episode ended",
                _BROKEN: "after it failed",
            }[state]
            raise FailedPrecondition(
                f"step of env {i} {why}: reset it first", field=f"step.text_actions[{k}]"
            )
        if message.get("role") not in _ROLES_IN:
            raise InvalidArgument(
                f"text action of env {i} has role {message.get('role')!r}: send the model's "
                "turn (role 'assistant')",
                field=f"step.text_actions[{k}].role",
            )
        calls = message.get("tool_calls") or []
        size = len(message.get("content") or "") + sum(
            len(c.get("function", {}).get("arguments") or "") for c in calls
        )
        if size > self.max_message_chars:
            raise InvalidArgument(
                f"text action of env {i} has {size} characters, over max_message_chars="
                f"{self.max_message_chars}",
                field=f"step.text_actions[{k}].content",
            )

    def _checked_reset(self, i: int, value: Any) -> tuple[list[Message], dict[str, Any]]:
        if not (isinstance(value, tuple) and len(value) == 2):
            self._state[i] = _BROKEN
            raise FailedPrecondition(f"env {i}: reset must return (messages, info)")
        messages, info = value
        return _messages(messages, i, "reset"), dict(info or {})

    def _checked_step(self, i: int, value: Any) -> tuple[float, bool, bool, TextTurn]:
        if not (isinstance(value, tuple) and len(value) == 5):
            raise ValueError("step must return (messages, reward, terminated, truncated, info)")
        messages, reward, terminated, truncated, info = value
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"step returned a non-finite reward {reward}")
        turn = TextTurn(i, _messages(messages, i, "step"), dict(info or {}))
        return reward, bool(terminated), bool(truncated), turn

    def _replace(self, i: int) -> None:
        """A fresh env in place of one that failed (closed in a thread: it may still hang)."""
        old, self.envs[i] = self.envs[i], self._made()
        threading.Thread(target=_close_quietly, args=(old,), daemon=True).start()

    def close(self) -> None:
        for env in self.envs:
            _close_quietly(env)


def _close_quietly(env: TextEnv) -> None:
    with contextlib.suppress(Exception):
        env.close()


def _messages(messages: Any, i: int, what: str) -> list[Message]:
    """An env's messages, checked: a list of dicts with a known role and string content."""
    if not isinstance(messages, list):
        raise ValueError(f"env {i}: {what} must return a list of messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _ROLES_OUT:
            raise ValueError(
                f"env {i}: {what} returned {message!r:.80}, not a message with a role of "
                + ", ".join(_ROLES_OUT)
            )
        if not isinstance(message.get("content", ""), str):
            raise ValueError(f"env {i}: {what} returned a message whose content is not text")
    return messages

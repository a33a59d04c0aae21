"""``OpenEnvText-v0``: an environment written for OpenEnv (``openenv-core``), played as a TextEnv.

OpenEnv environments subclass ``openenv.core.env_server.interfaces.Environment``: ``reset(seed,
episode_id)`` and ``step(action)`` return an ``Observation`` (a pydantic model with ``done``,
``reward`` and ``metadata`` beside the env's own fields), actions are an ``Action`` model. This
adapter runs one in-process, on the env server:

- ``env`` names the Environment class by reference (``path/to/file.py:Class`` or
  ``module:Class``, as env ids do), made with ``env_kwargs``;
- the model's reply fills the action's text field (``action_field``; by default the Action's only
  required ``str`` field), the rest of the action from its defaults; an action the model's text
  does not validate into is told back to the model as the user's turn, costing the turn;
- each observation becomes the user's turn: ``observation_fields`` (by default every field but
  ``done``, ``reward`` and ``metadata``), one field as its text, several as ``name: value`` lines;
  its ``reward`` is the step's reward (None: 0), ``done`` ends the episode (terminated), and its
  ``metadata`` goes into the info (plain values);
- ``max_turns`` replies end the episode truncated; ``split`` draws the episode seeds of train and
  eval from disjoint sets (an OpenEnv task is its seed);
- ``expert`` (optional) names a function by reference, ``f(observation) -> str``: the reply an
  expert gives to the latest observation. OpenEnv has no expert of its own; with one, the
  learner's SFT warm start has demonstrations.
"""

from __future__ import annotations

import json
import typing
import uuid
from typing import Any

from env_server.text.base import Message, TextEnv, TextStep, check_split, split_of
from services.references import import_reference_module, split_reference

__all__ = ["OpenEnvText"]

_OBSERVATION_BASE = ("done", "reward", "metadata")


class OpenEnvText(TextEnv):
    """An OpenEnv ``Environment`` class, each turn's observation a user message."""

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None = None,
        action_field: str | None = None,
        observation_fields: list[str] | None = None,
        system: str | None = None,
        split: str = "train",
        max_turns: int = 32,
        expert: str | None = None,
    ) -> None:
        try:
            from openenv.core.env_server.interfaces import Environment
        except ImportError as exc:
            raise ValueError(
                f"OpenEnvText-v0 needs openenv-core (docs/text_envs.md): {exc}"
            ) from exc
        super().__init__()
        self.split = check_split(split)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        cls = _load_reference(env, "env: path/to/file.py:Class or module:Class")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"env {env!r} is not an openenv Environment subclass")
        self.name, self.system, self.max_turns = env, system, max_turns
        self.action_type = _action_type(cls)
        self.action_field = action_field or _text_field(self.action_type)
        if self.action_field not in self.action_type.model_fields:
            raise ValueError(
                f"action_field {self.action_field!r} is not a field of "
                f"{self.action_type.__name__} ({', '.join(self.action_type.model_fields)})"
            )
        self.observation_fields = observation_fields
        self.expert = None
        if expert is not None:
            self.expert = _load_reference(expert, "expert: path/to/file.py:function")
            if not callable(self.expert):
                raise ValueError(f"expert {expert!r} is not a function")
        self.env = cls(**(env_kwargs or {}))
        self.turns = 0
        self.observation: Any = None  # the latest, what the expert answers

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        while split_of((self.name, task := self.rng.randrange(2**31))) != self.split:
            pass
        self.task, self.turns = task, 0
        observation = self.env.reset(seed=task, episode_id=uuid.uuid4().hex, **(options or {}))
        self.observation = observation
        opening = [self._observation(observation)]
        if self.system:
            opening.insert(0, {"role": "system", "content": self.system})
        return opening, _plain(observation.metadata)

    def step(self, message: Message) -> TextStep:
        from pydantic import ValidationError

        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        try:
            action = self.action_type(**{self.action_field: message.get("content") or ""})
        except ValidationError as exc:
            if out_of_turns:
                return [], 0.0, False, True, {"outcome": "max_turns"}
            reason = "; ".join(str(e["msg"]) for e in exc.errors())
            reply = {"role": "user", "content": f"That is not a valid action: {reason}"}
            return [reply], 0.0, False, False, {"outcome": "invalid_action"}
        observation = self.env.step(action)
        self.observation = observation
        reward = float(observation.reward or 0.0)
        done = bool(observation.done)
        truncated = out_of_turns and not done
        info = _plain(observation.metadata)
        if truncated:
            info["outcome"] = "max_turns"
        messages = [] if done or truncated else [self._observation(observation)]
        return messages, reward, done, truncated, info

    def expert_reply(self) -> Message | None:
        if self.expert is None:
            return None
        return {"role": "assistant", "content": str(self.expert(self.observation))}

    def _observation(self, observation: Any) -> Message:
        fields = self.observation_fields or [
            name for name in type(observation).model_fields if name not in _OBSERVATION_BASE
        ]
        values = {name: getattr(observation, name) for name in fields}
        if len(values) == 1:
            text = _text(next(iter(values.values())))
        else:
            text = "\n".join(f"{name}: {_text(value)}" for name, value in values.items())
        return {"role": "user", "content": text}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _load_reference(ref: str, form: str) -> Any:
    """What ``ref`` (``form``: the setting and the reference's shape) names."""
    where, attr = split_reference(ref, form)
    module, label, _ = import_reference_module(where)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{form.partition(':')[0]} {ref!r}: {label} has no {attr}") from None


def _action_type(cls: Any) -> Any:
    """The Action model an Environment subclass declares (``Environment[Act, Obs, State]``)."""
    from openenv.core.env_server.types import Action

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, Action) and arg is not Action:
                    return arg
    hints = typing.get_type_hints(cls.step)
    action = hints.get("action")
    if isinstance(action, type) and issubclass(action, Action):
        return action
    raise ValueError(f"{cls.__name__} declares no Action type (Environment[Act, Obs, State])")


def _text_field(action_type: Any) -> str:
    """The Action's only required ``str`` field: where the model's reply goes."""
    names = [
        name
        for name, field in action_type.model_fields.items()
        if field.is_required() and field.annotation is str
    ]
    if len(names) != 1:
        raise ValueError(
            f"{action_type.__name__} has {len(names)} required str fields "
            f"({', '.join(names) or 'none'}): name the one for the model's text in action_field"
        )
    return names[0]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON-plain values of an observation's metadata (what an info carries)."""
    return {k: v for k, v in values.items() if isinstance(v, bool | int | float | str)}

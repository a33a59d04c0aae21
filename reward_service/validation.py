"""Score requests checked in full, and turned into a plan, before any reward function runs.

Every problem is an InvalidArgument naming the offending field the way the client wrote it
(``rewards[1].name``, ``items[3].extra.prompts``), so a caller can fix the request without
reading server logs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format

from common import tensor
from reward_service.rewards.registry import BATCH_KEYS, RewardFunction
from reward_service.settings import RewardSettings
from rlfleet.reward.v1 import reward_pb2
from services.errors import InvalidArgument, Unavailable

__all__ = ["Batch", "Call", "Plan", "check_kwargs", "default_timeout_s", "plain", "validate"]


@dataclass(frozen=True)
class Batch:
    """The items as TRL-style columns: one list entry per item, None where an item lacks a value."""

    prompts: list[str]
    completions: list[str]
    prompt_ids: list[list[int] | None]
    completion_ids: list[list[int] | None]
    extras: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.completions)

    def columns(self) -> dict[str, list[Any]]:
        """Every keyword a function may receive besides ``completions``."""
        return {
            "prompts": self.prompts,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            **self.extras,
        }

    def item(self, i: int) -> Batch:
        """A batch of item ``i`` alone (for scoring item by item after a batch call failed)."""
        return Batch(
            prompts=self.prompts[i : i + 1],
            completions=self.completions[i : i + 1],
            prompt_ids=self.prompt_ids[i : i + 1],
            completion_ids=self.completion_ids[i : i + 1],
            extras={k: v[i : i + 1] for k, v in self.extras.items()},
        )


@dataclass(frozen=True)
class Call:
    """One reward function to run over the batch."""

    reward: RewardFunction
    weight: float
    timeout_s: float
    kwargs: dict[str, Any]  # hyperparameters: server defaults overridden by the request

    def to_proto(self) -> reward_pb2.RewardWeight:
        out = reward_pb2.RewardWeight(name=self.reward.name, weight=self.weight)
        out.timeout.FromNanoseconds(round(self.timeout_s * 1e9))
        if self.kwargs:
            out.kwargs.update(self.kwargs)
        return out


@dataclass(frozen=True)
class Plan:
    batch: Batch
    calls: list[Call]


def plain(value: Any) -> Any:
    """Struct numbers are doubles: give integral ones back as ints (``max_len: 512`` must stay
    an int; ``answer: 42`` should read "42", not "42.0")."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _struct(message: Any) -> dict[str, Any]:
    return plain(json_format.MessageToDict(message))


def _unknown_reward(name: str, known: list[str], field: str) -> InvalidArgument:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    listed = ", ".join(known) or "none"
    return InvalidArgument(f"unknown reward '{name}'{hint}; known: {listed}", field=field)


def _token_ids(item: reward_pb2.ScoreItem, which: str, field: str) -> list[int] | None:
    if not item.HasField(which):
        return None
    array = tensor.decode(getattr(item, which), name=field)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgument(
            f"{field}: expected a 1-D integer tensor, got {array.dtype} {list(array.shape)}",
            field=field,
        )
    return array.tolist()


def _batch(request: reward_pb2.ScoreRequest, settings: RewardSettings) -> Batch:
    if not request.items:
        raise InvalidArgument("items: at least one item is required", field="items")
    if len(request.items) > settings.max_items_per_request:
        raise InvalidArgument(
            f"items: {len(request.items)} items, over this server's max_items_per_request="
            f"{settings.max_items_per_request}; split the request",
            field="items",
        )
    extras_per_item: list[dict[str, Any]] = []
    prompt_ids: list[list[int] | None] = []
    completion_ids: list[list[int] | None] = []
    for i, item in enumerate(request.items):
        extra = _struct(item.extra)
        for key in extra:
            if key in BATCH_KEYS:
                raise InvalidArgument(
                    f"items[{i}].extra: key '{key}' is reserved (the service passes it)",
                    field=f"items[{i}].extra.{key}",
                )
        extras_per_item.append(extra)
        prompt_ids.append(_token_ids(item, "prompt_token_ids", f"items[{i}].prompt_token_ids"))
        completion_ids.append(
            _token_ids(item, "completion_token_ids", f"items[{i}].completion_token_ids")
        )
    keys = sorted({k for extra in extras_per_item for k in extra})
    return Batch(
        prompts=[item.prompt for item in request.items],
        completions=[item.completion for item in request.items],
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        extras={k: [extra.get(k) for extra in extras_per_item] for k in keys},
    )


def default_timeout_s(reward: RewardFunction, settings: RewardSettings) -> float:
    """The budget of a reward whose request sets no timeout."""
    return min(settings.timeouts.get(reward.name, reward.default_timeout_s), settings.max_timeout_s)


def check_kwargs(
    reward: RewardFunction,
    kwargs: Mapping[str, Any],
    field: str,
    extra_keys: Mapping[str, Any] | None = None,
) -> None:
    """InvalidArgument naming ``field.<key>`` for a keyword the reward does not take, one that
    shadows an extra key of the items, or a value its check rejects."""
    extra_keys = extra_keys or {}
    for key in kwargs:
        accepted = reward.kwargs is None or key in reward.kwargs
        if key in BATCH_KEYS or not accepted:
            takes = ", ".join(sorted(reward.kwargs or ())) or "none"
            raise InvalidArgument(
                f"reward '{reward.name}' takes no keyword '{key}' (takes: {takes})",
                field=f"{field}.{key}",
            )
        if key in extra_keys:
            raise InvalidArgument(
                f"keyword '{key}' of reward '{reward.name}' clashes with the extra key '{key}' "
                "of the items: rename one",
                field=f"{field}.{key}",
            )
    if reward.check_kwargs is not None:
        try:
            reward.check_kwargs(kwargs)
        except ValueError as exc:
            raise InvalidArgument(f"reward '{reward.name}': {exc}", field=field) from None


def _check_extras(reward: RewardFunction, request: reward_pb2.ScoreRequest) -> None:
    """An extra key named like one of the reward's hyperparameters would reach it as that
    hyperparameter (a list over the batch in place of a number): refuse it up front. Only for
    functions taking ``**kwargs`` with declared keywords (the built-ins): a plugin's named
    parameter may just as well be the column it reads (TRL's ``solution``)."""
    if reward.params is not None or not reward.kwargs:
        return
    for i, item in enumerate(request.items):
        for key in item.extra.fields:
            if key in reward.kwargs:
                raise InvalidArgument(
                    f"items[{i}].extra: key '{key}' is a keyword of reward '{reward.name}'; "
                    "rename the extra key",
                    field=f"items[{i}].extra.{key}",
                )


def _requested(request: reward_pb2.ScoreRequest, settings: RewardSettings) -> list[tuple]:
    """(field prefix, name, weight, timeout_s or None, kwargs) for each function to run."""
    if request.rewards:
        out = []
        for i, rw in enumerate(request.rewards):
            timeout = None
            if rw.HasField("timeout"):
                timeout = rw.timeout.ToNanoseconds() / 1e9
            out.append((f"rewards[{i}]", rw.name, rw.weight, timeout, _struct(rw.kwargs)))
        return out
    if not settings.rewards:
        raise InvalidArgument(
            "rewards: empty, and this server has no default set; name the rewards to run",
            field="rewards",
        )
    return [(f"settings.rewards.{n}", n, w, None, {}) for n, w in settings.rewards.items()]


def validate(
    request: reward_pb2.ScoreRequest,
    registry: Mapping[str, RewardFunction],
    settings: RewardSettings,
) -> Plan:
    """The plan for a Score request, or InvalidArgument for its first problem (Unavailable when
    a requested reward model is still loading)."""
    batch = _batch(request, settings)
    known = list(registry)
    seen: dict[str, str] = {}
    calls: list[Call] = []
    for field, name, weight, timeout_s, kwargs in _requested(request, settings):
        if not name:
            raise InvalidArgument(f"{field}.name: empty reward name", field=f"{field}.name")
        if name not in registry:
            raise _unknown_reward(name, known, f"{field}.name")
        if name in seen:
            raise InvalidArgument(
                f"reward '{name}' is named twice ({seen[name]} and {field})", field=f"{field}.name"
            )
        seen[name] = field
        if not math.isfinite(weight):
            raise InvalidArgument(
                f"{field}.weight: must be finite, got {weight}", field=f"{field}.weight"
            )
        if timeout_s is not None and timeout_s < 0:
            raise InvalidArgument(
                f"{field}.timeout: must not be negative, got {timeout_s:g}s",
                field=f"{field}.timeout",
            )
        reward = registry[name]
        merged = {**settings.reward_kwargs.get(name, {}), **kwargs}
        check_kwargs(reward, merged, f"{field}.kwargs", batch.extras)
        _check_extras(reward, request)
        timeout_s = (
            default_timeout_s(reward, settings)
            if timeout_s is None
            else min(timeout_s, settings.max_timeout_s)
        )
        calls.append(Call(reward, weight, timeout_s, merged))
    loading = [c.reward.name for c in calls if not c.reward.ready]
    if loading:
        raise Unavailable(f"reward model(s) still loading: {', '.join(loading)}; retry shortly")
    return Plan(batch=batch, calls=calls)

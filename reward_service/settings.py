"""Settings of a reward service (YAML ``settings:`` or ``RLFLEET_REWARD_SERVICE__<KEY>``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from reward_service.rewards.catalog import registered_names
from reward_service.rewards.registry import REFERENCE_FORMS, check_reference, is_reference
from services.config import StrictModel
from services.server import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["RewardModelSettings", "RewardSettings"]

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class RewardModelSettings(StrictModel):
    """One reward model served under ``name`` (see reward_service/models.py)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    path: Path  # local folder written by save_pretrained: config, weights, tokenizer
    max_length: int = Field(default=2048, ge=1)  # tokens of prompt + completion, left-truncated
    batch_size: int = Field(default=8, ge=1)  # items per forward pass
    device: str = "cpu"  # a torch device: "cpu", "cuda", "cuda:1"
    timeout_s: Seconds = 120.0  # default time budget per request
    description: str = ""  # shown by ListRewards; a generic one when empty


class RewardSettings(StrictModel):
    """What a reward service runs and within which limits."""

    # The default set, used when ScoreRequest.rewards is empty: {name: weight}, in report order.
    rewards: dict[str, FiniteFloat] = Field(default_factory=dict)
    # Default keyword arguments per reward ({"soft_overlong": {"max_completion_len": 4096}});
    # a request's kwargs override them key by key.
    reward_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    reward_models: list[RewardModelSettings] = Field(default_factory=list)
    # Functions named by reference, registered under that name beside the entry points:
    # "module:function" or "path/to/file.py:function" (relative to the current directory).
    # References used as keys of rewards, reward_kwargs or timeouts are registered too.
    plugins: list[str] = Field(default_factory=list)
    # Names the run's clients will ask for (a job lists its rewards here): each must be a
    # built-in, an installed `rlfleet.rewards` plugin, a reward model above or a reference, so a
    # typo fails `rlfleet validate` instead of every Score call.
    expected: list[str] = Field(default_factory=list, max_length=256)
    # Per-reward default time budgets overriding the function's own (RewardInfo.default_timeout).
    timeouts: dict[str, Seconds] = Field(default_factory=dict)
    # A request's timeouts are clamped to this: a hung plugin must not hold a request slot for
    # as long as a client cares to ask.
    max_timeout_s: Seconds = 600.0
    max_items_per_request: int = Field(default=4096, ge=1)
    # Score calls running at once; more are RESOURCE_EXHAUSTED (the client retries later).
    max_concurrent_requests: int = Field(default=32, ge=1)
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1 << 20)
    # Worker threads running sync reward functions and reward models, shared by all requests
    # (async functions run on a loop and thread of their own each; see runner.py).
    worker_threads: int = Field(default=64, ge=1)
    # The most workers one function holds at once; its further calls wait, within their budget.
    max_threads_per_function: int = Field(default=16, ge=1)
    # Calls of one function abandoned (over budget, or their request cancelled) and still
    # running; at this many the function is UNAVAILABLE, in-band, until one of them returns.
    max_stuck_calls: int = Field(default=4, ge=1)

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, refs: list[str]) -> list[str]:
        for ref in refs:
            if not is_reference(ref):
                raise ValueError(f"'{ref}' is not a reference ({REFERENCE_FORMS})")
        twice = sorted({ref for ref in refs if refs.count(ref) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        _check_references(refs)
        return refs

    @field_validator("rewards", "timeouts")
    @classmethod
    def _referenced(cls, names: dict[str, Any]) -> dict[str, Any]:
        _check_references(names)
        return names

    @field_validator("reward_kwargs")
    @classmethod
    def _referenced_with_kwargs(
        cls, kwargs: dict[str, dict[str, Any]], info: ValidationInfo
    ) -> dict[str, Any]:
        # A reference's keyword arguments are known here: check them against its signature,
        # and its other required parameters against the dataset's columns where a job gives them
        # (context "dataset_columns").
        columns = (info.context or {}).get("dataset_columns")
        for name, given in kwargs.items():
            if is_reference(name):
                check_reference(name, given, columns)
        return kwargs

    @property
    def references(self) -> list[str]:
        """Every reference to register: ``plugins``, then those named only as keys elsewhere."""
        found = dict.fromkeys(self.plugins)
        for names in (self.rewards, self.reward_kwargs, self.timeouts):
            found.update(dict.fromkeys(n for n in names if is_reference(n)))
        return list(found)

    @model_validator(mode="after")
    def _expected_known(self) -> RewardSettings:
        known = {*registered_names(), *(m.name for m in self.reward_models)}
        for name in self.expected:
            if is_reference(name):
                check_reference(name)
            elif name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(
                    f"reward '{name}' is not registered{hint}; known: {', '.join(sorted(known))}"
                    f", or name a function as {REFERENCE_FORMS}"
                )
        return self

    @model_validator(mode="after")
    def _workers_nest(self) -> RewardSettings:
        if not self.max_stuck_calls <= self.max_threads_per_function <= self.worker_threads:
            raise ValueError(
                "need max_stuck_calls <= max_threads_per_function <= worker_threads, got "
                f"{self.max_stuck_calls}, {self.max_threads_per_function}, {self.worker_threads}"
            )
        return self


def _check_references(names: Iterable[str]) -> None:
    """Import and check the references among ``names`` now, at config load (ValueError)."""
    for name in names:
        if is_reference(name):
            check_reference(name)

"""Settings of a reward service (YAML ``settings:`` or ``RLFLEET_REWARD_SERVICE__<KEY>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

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
    # Per-reward default time budgets overriding the function's own (RewardInfo.default_timeout).
    timeouts: dict[str, Seconds] = Field(default_factory=dict)
    # A request's timeouts are clamped to this: a hung plugin must not hold a request slot for
    # as long as a client cares to ask.
    max_timeout_s: Seconds = 600.0
    max_items_per_request: int = Field(default=4096, ge=1)
    # Score calls running at once; more are RESOURCE_EXHAUSTED (the client retries later).
    max_concurrent_requests: int = Field(default=32, ge=1)
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1 << 20)

"""Built-in rule rewards, each a pure TRL-style function, and their registry records."""

from __future__ import annotations

from reward_service.rewards.accuracy import accuracy
from reward_service.rewards.catalog import BUILTINS, load_registry, registered_names
from reward_service.rewards.format import format_reward
from reward_service.rewards.length import cosine, soft_overlong
from reward_service.rewards.registry import Kind, RewardFunction, RewardRegistry, from_callable
from reward_service.rewards.repetition import repetition

__all__ = [
    "BUILTINS",
    "Kind",
    "RewardFunction",
    "RewardRegistry",
    "accuracy",
    "cosine",
    "format_reward",
    "from_callable",
    "load_registry",
    "registered_names",
    "repetition",
    "soft_overlong",
]

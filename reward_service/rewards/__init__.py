"""Built-in rule rewards, each a pure TRL-style function, and their registry records."""

from __future__ import annotations

from reward_service.rewards.accuracy import accuracy
from reward_service.rewards.format import check_format_kwargs, format_reward
from reward_service.rewards.length import (
    check_cosine_kwargs,
    check_overlong_kwargs,
    cosine,
    soft_overlong,
)
from reward_service.rewards.registry import (
    Kind,
    RewardFunction,
    RewardRegistry,
    from_callable,
    load_registry,
)
from reward_service.rewards.repetition import check_repetition_kwargs, repetition

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
    "repetition",
    "soft_overlong",
]


def _rule(name, fn, *, extra_keys=(), kwargs=(), check=None, timeout_s=10.0) -> RewardFunction:
    # Built-ins take **kwargs (so they also work inside TRL unchanged) but read only the keywords
    # listed here; a request setting any other is INVALID_ARGUMENT.
    return from_callable(
        name,
        fn,
        kind=Kind.RULE,
        source=f"built-in {fn.__module__}:{fn.__name__}",
        extra_keys=extra_keys,
        kwargs=kwargs,
        check_kwargs=check,
        default_timeout_s=timeout_s,
    )


BUILTINS: tuple[RewardFunction, ...] = (
    _rule("accuracy", accuracy, extra_keys=("answer",)),
    _rule("format", format_reward, kwargs=("tags", "pattern"), check=check_format_kwargs),
    _rule(
        "soft_overlong",
        soft_overlong,
        kwargs=("max_completion_len", "cache_len"),
        check=check_overlong_kwargs,
    ),
    _rule(
        "repetition",
        repetition,
        kwargs=("ngram_size", "max_penalty"),
        check=check_repetition_kwargs,
    ),
    _rule(
        "cosine",
        cosine,
        extra_keys=("answer",),
        kwargs=(
            "max_len",
            "min_value_wrong",
            "max_value_wrong",
            "min_value_correct",
            "max_value_correct",
        ),
        check=check_cosine_kwargs,
    ),
)

"""Length-shaped rewards: `soft_overlong` (DAPO) and `cosine` (cosine length scaling).

Lengths are token counts from ``completion_ids``; an item without token ids abstains, since a
character count would silently change the unit of the length limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from reward_service.rewards.accuracy import is_correct

__all__ = [
    "check_cosine_kwargs",
    "check_overlong_kwargs",
    "cosine",
    "cosine_scale",
    "overlong_penalty",
    "soft_overlong",
]


def overlong_penalty(length: int, max_completion_len: int, cache_len: int) -> float:
    """DAPO eq. 13: 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond."""
    expected = max_completion_len - cache_len
    if length <= expected:
        return 0.0
    if length <= max_completion_len:
        return (expected - length) / cache_len
    return -1.0


def _positive_int(kwargs: Mapping[str, Any], key: str, default: int) -> int:
    value = kwargs.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"'{key}' must be a positive integer, got {value!r}")
    return value


def check_overlong_kwargs(kwargs: Mapping[str, Any]) -> None:
    max_len = _positive_int(kwargs, "max_completion_len", 20480)
    cache = _positive_int(kwargs, "cache_len", 4096)
    if cache > max_len:
        raise ValueError(f"'cache_len' ({cache}) must not exceed max_completion_len ({max_len})")


def _lengths(completion_ids: Sequence[Sequence[int] | None] | None, n: int) -> list[int | None]:
    if completion_ids is None:
        return [None] * n
    return [None if ids is None else len(ids) for ids in completion_ids]


def soft_overlong(
    completions: list[str],
    completion_ids: list[list[int] | None] | None = None,
    *,
    max_completion_len: int = 20480,
    cache_len: int = 4096,
    **kwargs: Any,
) -> list[float | None]:
    """Soft overlong punishment: 0 for completions up to ``max_completion_len - cache_len``
    tokens, falling linearly to -1 at ``max_completion_len``, -1 beyond.

    Range [-1, 0]. Abstains on items without completion token ids. Defaults are the paper's
    (L_max 20480, L_cache 4096). Source: DAPO (arXiv:2503.14476), eq. 13.
    """
    check_overlong_kwargs({"max_completion_len": max_completion_len, "cache_len": cache_len})
    return [
        None if n is None else overlong_penalty(n, int(max_completion_len), int(cache_len))
        for n in _lengths(completion_ids, len(completions))
    ]


_COSINE_DEFAULTS = {
    "min_value_wrong": -1.0,
    "max_value_wrong": -0.5,
    "min_value_correct": 0.5,
    "max_value_correct": 1.0,
}


def cosine_scale(length: int, max_len: int, correct: bool, values: Mapping[str, float]) -> float:
    """Open-R1's cosine schedule. Correct: max_value_correct at length 0 falling to
    min_value_correct at max_len (shorter is better). Wrong: min_value_wrong at length 0 rising
    to max_value_wrong at max_len (a long wrong attempt is punished less than a short one).
    Lengths past max_len count as max_len (Open-R1 lets the cosine wrap around instead)."""
    progress = min(length / max_len, 1.0)
    cos = math.cos(progress * math.pi)
    if correct:
        start, end = values["max_value_correct"], values["min_value_correct"]
    else:
        start, end = values["min_value_wrong"], values["max_value_wrong"]
    return end + 0.5 * (start - end) * (1.0 + cos)


def check_cosine_kwargs(kwargs: Mapping[str, Any]) -> None:
    _positive_int(kwargs, "max_len", 1000)
    for key, default in _COSINE_DEFAULTS.items():
        value = kwargs.get(key, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value):
            raise ValueError(f"'{key}' must be a finite number, got {value!r}")


def cosine(
    completions: list[str],
    completion_ids: list[list[int] | None] | None = None,
    answer: list[Any] | None = None,
    *,
    max_len: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    **kwargs: Any,
) -> list[float | None]:
    """Correctness (as `accuracy` judges it) scaled by length on a cosine schedule.

    Correct answers score from ``max_value_correct`` (empty) down to ``min_value_correct`` (at
    ``max_len`` tokens or more); wrong ones from ``min_value_wrong`` up to ``max_value_wrong``.
    Range [min_value_wrong, max_value_correct] with the defaults [-1, 1]. Abstains on items
    without an ``answer`` or without completion token ids. Source: Yeo et al. 2025
    (arXiv:2502.03373), as Open-R1 ``get_cosine_scaled_reward``.
    """
    values = {
        "min_value_wrong": min_value_wrong,
        "max_value_wrong": max_value_wrong,
        "min_value_correct": min_value_correct,
        "max_value_correct": max_value_correct,
    }
    check_cosine_kwargs({"max_len": max_len, **values})
    answers = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = []
    for completion, ref, n in zip(
        completions, answers, _lengths(completion_ids, len(completions)), strict=True
    ):
        correct = None if n is None else is_correct(completion, ref)
        if n is None or correct is None:
            scores.append(None)
        else:
            scores.append(cosine_scale(n, int(max_len), correct, values))
    return scores

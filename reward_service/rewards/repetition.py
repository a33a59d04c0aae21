"""`repetition`: a penalty for repeated word n-grams."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["check_repetition_kwargs", "repetition", "repetition_penalty"]


def repetition_penalty(text: str, ngram_size: int, max_penalty: float) -> float:
    """``max_penalty * (1 - unique n-grams / n-grams)`` over lower-cased whitespace words; 0 for
    texts shorter than one n-gram."""
    words = text.lower().split()
    if len(words) < ngram_size:
        return 0.0
    ngrams = list(zip(*(words[i:] for i in range(ngram_size)), strict=False))
    repeated_fraction = 1.0 - len(set(ngrams)) / len(ngrams)
    return repeated_fraction * max_penalty + 0.0  # + 0.0: no -0.0 for a text without repeats


def check_repetition_kwargs(kwargs: Mapping[str, Any]) -> None:
    size = kwargs.get("ngram_size", 3)
    if isinstance(size, float) and size.is_integer():
        size = int(size)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"'ngram_size' must be a positive integer, got {size!r}")
    penalty = kwargs.get("max_penalty", -1.0)
    ok = isinstance(penalty, int | float) and not isinstance(penalty, bool)
    if not ok or not math.isfinite(penalty) or penalty > 0:
        raise ValueError(f"'max_penalty' must be a finite number <= 0, got {penalty!r}")


def repetition(
    completions: list[str], *, ngram_size: int = 3, max_penalty: float = -1.0, **kwargs: Any
) -> list[float | None]:
    """N-gram repetition penalty: ``max_penalty`` times the fraction of repeated word n-grams.

    0 for a completion without repeats (or shorter than ``ngram_size`` words), approaching
    ``max_penalty`` (<= 0, default -1) as it repeats itself. Range [max_penalty, 0]. Never
    abstains. Source: Open-R1 ``get_repetition_penalty_reward`` / ms-swift ``repetition``
    (Yeo et al. 2025, arXiv:2502.03373).
    """
    check_repetition_kwargs({"ngram_size": ngram_size, "max_penalty": max_penalty})
    return [repetition_penalty(c, int(ngram_size), float(max_penalty)) for c in completions]

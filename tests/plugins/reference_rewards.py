"""Reward functions the tests name by reference (``tests.plugins.reference_rewards:name``), each
with a signature the config-load check accepts or refuses."""

from __future__ import annotations

from typing import Any


def scaled(completions: list[str], *, scale: float = 1.0) -> list[float]:
    """scale for every completion."""
    return [scale] * len(completions)


def needs_level(completions: list[str], level: int) -> list[float]:
    """A hyperparameter with no default: the run must set it."""
    return [float(level)] * len(completions)


def needs_prompts_and_target(completions: list[str], prompts: list[str], target: list[Any]):
    """Required keywords the service passes: a batch column and a listed extra key."""
    return [0.0] * len(completions)


needs_prompts_and_target.extra_keys = ("target",)  # type: ignore[attr-defined]


def trl_accuracy(completions: list[str], solution: list[str], **kwargs: Any) -> list[float]:
    """Written for TRL: a required dataset column (``solution``), listed nowhere."""
    return [float(c.strip() == s.strip()) for c, s in zip(completions, solution, strict=True)]


def keyword_only(*, completions: list[str]) -> list[float]:
    """Completions by keyword only: the service passes them positionally."""
    return [0.0] * len(completions)


def misnamed(texts: list[str], **kwargs: Any) -> list[float]:
    """A first parameter not called completions."""
    return [0.0] * len(texts)


NOT_CALLABLE = 3

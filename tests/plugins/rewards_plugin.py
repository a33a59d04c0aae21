"""Reward plugins for the tests, loaded through `rlfleet.rewards` entry points made in the tests
(nothing is installed). Each misbehaves in one way a user's plugin might."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def length_ratio(completions: list[str], target: list[Any] | None = None, **kwargs: Any):
    """Length of the completion over the ``target`` length (extra key); abstains without one."""
    targets = target or [None] * len(completions)
    return [None if t is None else len(c) / t for c, t in zip(completions, targets, strict=True)]


length_ratio.extra_keys = ("target",)


def raise_on_bad(completions: list[str], *, scale: float = 1.0) -> list[float]:
    """scale for every completion; raises on one containing "bad" (a bug hit by one item)."""
    for c in completions:
        if "bad" in c:
            raise ZeroDivisionError(f"cannot score {c!r}")
    return [scale] * len(completions)


def nan_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """NaN for every completion."""
    return [float("nan")] * len(completions)


def short_list(completions: list[str], **kwargs: Any) -> list[float]:
    """One score too few."""
    return [1.0] * (len(completions) - 1)


def slow(completions: list[str], **kwargs: Any) -> list[float]:
    """Sleeps 5 s in its thread, then 1.0 each: overruns any short budget."""
    time.sleep(5)
    return [1.0] * len(completions)


async def async_echo(completions: list[str], prompts: list[str], **kwargs: Any) -> list[float]:
    """Async: 1.0 when the completion repeats the prompt, else 0.0."""
    await asyncio.sleep(0)
    return [float(c == p) for c, p in zip(completions, prompts, strict=True)]


NOT_CALLABLE = 42  # an entry point naming this is a start-up error

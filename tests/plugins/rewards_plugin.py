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


# Plugins that try to take the server down with them (tests/contract/test_reward_service.py
# serves them on a server of their own).
BLOCK_S = 3.0  # how long the blocking ones block: far over their budget in the tests


def exits(completions: list[str], **kwargs: Any) -> list[float]:
    """Calls sys.exit, as a script-minded plugin might."""
    raise SystemExit(3)


def interrupts(completions: list[str], **kwargs: Any) -> list[float]:
    """Raises KeyboardInterrupt."""
    raise KeyboardInterrupt


def generator_exit(completions: list[str], **kwargs: Any) -> list[float]:
    """Raises GeneratorExit outside any generator."""
    raise GeneratorExit


async def async_exits(completions: list[str], **kwargs: Any) -> list[float]:
    """Async: calls sys.exit (a task raising SystemExit stops the loop that runs it)."""
    await asyncio.sleep(0)
    raise SystemExit(4)


async def async_interrupts(completions: list[str], **kwargs: Any) -> list[float]:
    """Async: raises KeyboardInterrupt."""
    raise KeyboardInterrupt


async def async_cancels_itself(completions: list[str], **kwargs: Any) -> list[float]:
    """Async: raises a CancelledError of its own (not the server cancelling it)."""
    raise asyncio.CancelledError("plugin's own")


def sleeps(completions: list[str], **kwargs: Any) -> list[float]:
    """Blocks its thread for BLOCK_S."""
    time.sleep(BLOCK_S)
    return [1.0] * len(completions)


async def async_sleeps(completions: list[str], **kwargs: Any) -> list[float]:
    """Async, but blocks with time.sleep for BLOCK_S: freezes the loop it runs on."""
    time.sleep(BLOCK_S)
    return [1.0] * len(completions)


def hangs(completions: list[str], **kwargs: Any) -> list[float]:
    """Blocks its thread for 1.5 s each call (a function that keeps timing out)."""
    time.sleep(1.5)
    return [1.0] * len(completions)


async def async_hangs(completions: list[str], **kwargs: Any) -> list[float]:
    """Async, blocking its loop for 1.5 s each call."""
    time.sleep(1.5)
    return [1.0] * len(completions)

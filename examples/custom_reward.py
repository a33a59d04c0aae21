# Reward functions defined in a plain file, for examples/grpo_custom_reward.yaml.
#
# A run names one as `rewards: [{name: examples/custom_reward.py:brevity, ...}]` (a path
# relative to the directory `rlfleet` runs from, then the function): `rlfleet validate` imports
# this file and checks each function's signature against the kwargs the run gives it, and the
# reward service imports it again at its start and registers the reference (the name as
# written, also the metric's: reward/examples/custom_reward.py:brevity) beside its built-ins.
# Nothing needs installing. The signature is TRL's, so the same functions work in TRL as is:
# f(completions, **kwargs) -> list[float | None] (None abstains); keywords a function names
# receive the batch columns (prompts, prompt_ids, completion_ids), every dataset column (as in
# TRL: arith's answer and solution, a JSONL file's keys) and the run's kwargs for it.
"""Example reward functions in TRL's signature."""

from __future__ import annotations

from typing import Any


def brevity(completions: list[str], max_chars: int = 16, **kwargs: Any) -> list[float]:
    """1 for a completion of at most ``max_chars`` characters, falling linearly to 0 at twice
    that; rewards short answers (compare the built-in soft_overlong, which works on tokens)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    return [min(max(2.0 - len(c.strip()) / max_chars, 0.0), 1.0) for c in completions]


def exact_answer(
    completions: list[str], answer: list[str | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """1 when the completion's last word is the item's ``answer`` extra, else 0; abstains on an
    item without one."""
    answers = answer or [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, answers, strict=True):
        words = completion.replace("<answer>", " ").replace("</answer>", " ").split()
        out.append(None if expected is None else float(bool(words) and words[-1] == expected))
    return out


exact_answer.extra_keys = ("answer",)  # type: ignore[attr-defined]  # items must carry it

"""`format`: does the completion follow the expected tag layout?"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_TAGS", "check_format_kwargs", "format_pattern", "format_reward"]

DEFAULT_TAGS = ("think", "answer")
_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def format_pattern(tags: Sequence[str] | None = None, pattern: str | None = None) -> re.Pattern:
    """The compiled regex a completion must match in full (DOTALL: ``.`` spans lines).

    ``tags`` builds ``<t1>...</t1> <t2>...</t2>``: every tag in order, each once, separated and
    surrounded by whitespace only.
    """
    if pattern is not None and tags is not None:
        raise ValueError("give either 'pattern' or 'tags', not both")
    if pattern is None:
        names = list(DEFAULT_TAGS if tags is None else tags)
        if not names or not all(isinstance(t, str) and _TAG_NAME.fullmatch(t) for t in names):
            raise ValueError(f"'tags' must be a non-empty list of tag names, got {tags!r}")
        pattern = r"\s*" + r"\s*".join(rf"<{t}>.*?</{t}>" for t in names) + r"\s*"
    if not isinstance(pattern, str):
        raise ValueError(f"'pattern' must be a string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"'pattern' is not a valid regex: {exc}") from None


def check_format_kwargs(kwargs: Mapping[str, Any]) -> None:
    format_pattern(kwargs.get("tags"), kwargs.get("pattern"))


def format_reward(
    completions: list[str],
    *,
    tags: Sequence[str] | None = None,
    pattern: str | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the whole completion matches the expected layout, else 0.0.

    Default layout ``<think>...</think><answer>...</answer>`` (whitespace allowed between and
    around the blocks); ``tags`` (list of tag names, in order) or ``pattern`` (a regex matched
    against the whole completion, ``.`` spanning lines) replace it. Never abstains. Range {0, 1}.
    Source: Open-R1 / ms-swift ``format`` reward (DeepSeek-R1 template).
    """
    regex = format_pattern(tags, pattern)
    return [1.0 if regex.fullmatch(c) else 0.0 for c in completions]

"""`accuracy`: is the completion's final answer mathematically equal to the reference?"""

from __future__ import annotations

import functools
import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["accuracy", "extract_answer", "is_correct"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A plain decimal number ("42", "-3.50"): compared exactly without sympy, which is what most
# arithmetic answers are; anything else goes through math-verify.
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # no "+": math-verify reads "+3" as nothing

# math-verify guards parse/verify with signal.alarm, which only works on the main thread; rewards
# run in worker threads, so its timeouts are off (None) and the service's per-function time
# budget bounds a runaway sympy call instead. Its one-off warning about that is expected.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def extract_answer(completion: str) -> str:
    """The content of the last ``<answer>...</answer>`` block, else the whole completion."""
    found = _ANSWER_TAG.findall(completion)
    return found[-1].strip() if found else completion


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _reference_text(answer: Any) -> str | None:
    if answer is None:
        return None
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # a JSON number 42.0 means the answer "42"
    text = str(answer).strip()
    return text or None


def _plain_number(text: str) -> Decimal | None:
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # the pattern admits only what Decimal parses; be safe anyway
        return None


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> tuple[Any, ...]:
    """math-verify's parse, cached: a group's completions share one reference and often one
    answer, and parsing (sympy) is what scoring costs. Parsed values are never mutated."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return tuple(parse(text, extraction_config=configs, parsing_timeout=None))


def is_correct(completion: str, answer: Any) -> bool | None:
    """Whether the completion's answer equals ``answer``; None when there is no reference."""
    from math_verify import verify

    reference = _reference_text(answer)
    if reference is None:
        return None
    predicted = extract_answer(completion).strip()
    gold_number, pred_number = _plain_number(reference), _plain_number(predicted)
    if gold_number is not None and pred_number is not None:
        return gold_number == pred_number  # "42" == "42.0", as math-verify would say
    gold = _parse(reference)
    if not gold:
        # Not mathematics ("Paris"): fall back to comparing the texts, case and spacing aside.
        return _normalize(predicted) == _normalize(reference)
    pred = _parse(predicted)
    if not pred:
        return False
    return bool(verify(list(gold), list(pred), timeout_seconds=None))


def accuracy(
    completions: list[str], answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer equals the reference ``answer`` (extra key), else 0.0.

    The answer is the last ``<answer>...</answer>`` block if there is one, else the whole
    completion; both sides are parsed and compared with math-verify (LaTeX, ``\\boxed{}`` and
    plain expressions, so "42", "$\\frac12$" and "0.5" are handled), and a reference that is not
    mathematics is compared as text (case and spacing ignored). Abstains (None) on items without
    an ``answer``. Range {0, 1}. Source: Open-R1 ``accuracy_reward`` (math-verify).
    """
    answers = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = []
    for completion, ref in zip(completions, answers, strict=True):
        correct = is_correct(completion, ref)
        scores.append(None if correct is None else float(correct))
    return scores

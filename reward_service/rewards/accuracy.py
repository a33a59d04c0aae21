"""`accuracy`: is the completion's final answer mathematically equal to the reference?"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["accuracy", "extract_answer", "is_correct"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

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


def is_correct(completion: str, answer: Any) -> bool | None:
    """Whether the completion's answer equals ``answer``; None when there is no reference."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    reference = _reference_text(answer)
    if reference is None:
        return None
    predicted = extract_answer(completion)
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = parse(reference, extraction_config=configs, parsing_timeout=None)
    if not gold:
        # Not mathematics ("Paris"): fall back to comparing the texts, case and spacing aside.
        return _normalize(predicted) == _normalize(reference)
    pred = parse(predicted, extraction_config=configs, parsing_timeout=None)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


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

"""Built-in rule rewards against hand-computed values and the formulas they cite."""

from __future__ import annotations

import math

import pytest

from reward_service.rewards import accuracy, cosine, format_reward, repetition, soft_overlong
from reward_service.rewards.accuracy import extract_answer
from reward_service.rewards.length import check_overlong_kwargs, cosine_scale
from reward_service.rewards.repetition import check_repetition_kwargs


def ids(n: int) -> list[int]:
    return list(range(n))


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("<think>6*7</think><answer>42</answer>", "42", 1.0),
        ("<answer>41</answer> though 42 appears here", "42", 0.0),  # the tag wins
        ("The result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<answer>$\\frac12$</answer>", "1/2", 1.0),
        ("so x = 3", "3", 1.0),
        ("no number here", "42", 0.0),
        ("<answer> paris </answer>", "Paris", 1.0),  # not mathematics: compared as text
        ("<answer>42</answer>", 42, 1.0),  # a JSON number as the reference
        ("<answer>42</answer>", 42.0, 1.0),
        ("<answer>42</answer>", None, None),  # no reference: abstain
        ("<answer>42</answer>", "  ", None),
    ],
)
def test_accuracy(completion: str, answer: object, expected: float | None) -> None:
    assert accuracy([completion], answer=[answer]) == [expected]


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [("42", "42"), ("42.0", "42"), ("-7", "-7"), ("007", "7"), ("41", "42"), ("3.5", "3.50"),
     ("0.5", "1/2"), ("1,000", "1000"), ("+3", "3"), ("2.0001", "2")],
)  # fmt: skip
def test_plain_numbers_are_judged_as_math_verify_judges_them(predicted: str, reference: str):
    """The fast path for plain decimal numbers (no sympy) agrees with math-verify itself."""
    from math_verify import parse, verify

    fast = accuracy([f"<answer>{predicted}</answer>"], answer=[reference])
    slow = float(verify(parse(reference), parse(predicted)))
    assert fast == [slow], (predicted, reference)


def test_accuracy_without_answer_column_abstains_and_last_tag_is_the_answer() -> None:
    assert accuracy(["<answer>1</answer>", "x"]) == [None, None]
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("plain") == "plain"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a\nb</think><answer>1</answer>", 1.0),
        ("  <think>a</think>\n\n<answer>1</answer>\n", 1.0),
        ("<answer>1</answer><think>a</think>", 0.0),  # wrong order
        ("<think>a</think>", 0.0),  # missing answer
        ("intro <think>a</think><answer>1</answer>", 0.0),  # text outside the tags
    ],
)
def test_format_default_layout(completion: str, expected: float) -> None:
    assert format_reward([completion]) == [expected]


def test_format_tags_and_pattern_kwargs() -> None:
    assert format_reward(
        ["<reasoning>r</reasoning> <answer>1</answer>"], tags=["reasoning", "answer"]
    ) == [1.0]
    assert format_reward(["<think>x</think><answer>1</answer>"], tags=["answer"]) == [0.0]
    assert format_reward(["ANSWER: 12", "answer 12"], pattern=r"ANSWER: \d+") == [1.0, 0.0]
    with pytest.raises(ValueError, match="not both"):
        format_reward(["x"], tags=["a"], pattern="x")
    with pytest.raises(ValueError, match="not a valid regex"):
        format_reward(["x"], pattern="(")
    with pytest.raises(ValueError, match="tag names"):
        format_reward(["x"], tags=["a b"])


def test_soft_overlong_follows_dapo_eq_13() -> None:
    # L_max = 100, L_cache = 20: 0 up to 80 tokens, (80 - |y|) / 20 up to 100, -1 beyond.
    lengths = [0, 80, 81, 90, 100, 101, 500]
    expected = [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]
    got = soft_overlong(
        ["x"] * len(lengths),
        completion_ids=[ids(n) for n in lengths],
        max_completion_len=100,
        cache_len=20,
    )
    assert got == pytest.approx(expected)
    for n, score in zip(lengths, got, strict=True):
        if 80 < n <= 100:
            assert score == pytest.approx(((100 - 20) - n) / 20)


def test_soft_overlong_abstains_without_token_ids_and_checks_kwargs() -> None:
    got = soft_overlong(
        ["a", "b"], completion_ids=[None, ids(3)], max_completion_len=4, cache_len=2
    )
    assert got == [None, -0.5]  # ((4 - 2) - 3) / 2
    assert soft_overlong(["a"]) == [None]
    with pytest.raises(ValueError, match="cache_len"):
        check_overlong_kwargs({"max_completion_len": 10, "cache_len": 11})
    with pytest.raises(ValueError, match="positive integer"):
        check_overlong_kwargs({"max_completion_len": 0})


def test_repetition_penalty_is_the_repeated_ngram_fraction() -> None:
    # 6 words -> 4 trigrams, all distinct: no penalty.
    assert repetition(["a b c d e f"]) == [0.0]
    # "a b a b a b": trigrams aba, bab, aba, bab -> 2 unique of 4 -> 0.5 repeated.
    assert repetition(["a b a b a b"], max_penalty=-1.0) == [pytest.approx(-0.5)]
    # Bigrams of "x x x x x": 4, one unique -> 0.75 repeated, scaled by -2.
    assert repetition(["x x x x x"], ngram_size=2, max_penalty=-2.0) == [pytest.approx(-1.5)]
    assert repetition(["", "too short"]) == [0.0, 0.0]
    assert repetition(["The the THE the"], ngram_size=1) == [pytest.approx(-0.75)]  # lower-cased
    with pytest.raises(ValueError, match="<= 0"):
        check_repetition_kwargs({"max_penalty": 0.5})


DEFAULTS = {
    "min_value_wrong": -1.0,
    "max_value_wrong": -0.5,
    "min_value_correct": 0.5,
    "max_value_correct": 1.0,
}


def test_cosine_endpoints_and_midpoint() -> None:
    assert cosine_scale(0, 100, True, DEFAULTS) == pytest.approx(1.0)
    assert cosine_scale(100, 100, True, DEFAULTS) == pytest.approx(0.5)
    assert cosine_scale(50, 100, True, DEFAULTS) == pytest.approx(0.75)
    assert cosine_scale(0, 100, False, DEFAULTS) == pytest.approx(-1.0)
    assert cosine_scale(100, 100, False, DEFAULTS) == pytest.approx(-0.5)
    assert cosine_scale(400, 100, False, DEFAULTS) == pytest.approx(-0.5)  # clamped past max_len
    # Open-R1's formula at an arbitrary point.
    progress = 30 / 100
    want = 0.5 + 0.5 * (1.0 - 0.5) * (1.0 + math.cos(progress * math.pi))
    assert cosine_scale(30, 100, True, DEFAULTS) == pytest.approx(want)


def test_cosine_reward_judges_correctness_and_abstains() -> None:
    got = cosine(
        ["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>", "<answer>4</answer>"],
        completion_ids=[ids(0), ids(10), None, ids(10)],
        answer=["4", "4", "4", None],
        max_len=10,
        min_value_correct=0.0,
    )
    assert got == [pytest.approx(1.0), pytest.approx(-0.5), None, None]

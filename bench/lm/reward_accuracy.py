"""What the `accuracy` reward costs per rollout call: the built-in against the plain math-verify
loop it replaced (parse both sides, verify, for every completion), in the same run.

    .venv/bin/python -m bench.lm.reward_accuracy [--groups 8 --group-size 16 --rounds 20]

The completions are GRPO-shaped: `--groups` arith prompts (the generator the GRPO example trains
on), `--group-size` completions each, half of them right, the rest off by a little, some in
LaTeX (`\\frac`, `\\boxed`) so the math-verify path is taken too. Prints a table and writes
bench/results/reward_accuracy.json: `ms_per_call_before`, `ms_per_call_after` (medians over
`--rounds` calls, each on new prompts; the parse cache is kept across calls, as the service
keeps it), `speedup`, and whether both judged every item the same (`same_scores`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench._shared.lm import arith_tasks
from bench._shared.results import RESULTS_DIR, machine, write_results
from reward_service.rewards.accuracy import accuracy, extract_answer


def completions(groups: int, group_size: int, seed: int) -> tuple[list[str], list[Any]]:
    rng = random.Random(seed)
    texts, answers = [], []
    for task in arith_tasks(groups, seed=seed):
        answer = task.extra["answer"]
        for _ in range(group_size):
            value = int(answer) + (0 if rng.random() < 0.5 else rng.randint(-3, 3))
            shape = rng.random()
            if shape < 0.8:
                body = str(value)
            elif shape < 0.9:
                body = f"\\boxed{{{value}}}"
            else:
                body = f"$\\frac{{{2 * value}}}{{2}}$"
            texts.append(f"{task.prompt} <think>adding</think><answer>{body}</answer>")
            answers.append(answer)
    return texts, answers


def math_verify_loop(texts: list[str], answers: list[Any]) -> list[float]:
    """The reward as it was: math-verify's parse and verify on every item."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    scores = []
    for text, answer in zip(texts, answers, strict=True):
        gold = parse(str(answer), extraction_config=configs, parsing_timeout=None)
        pred = parse(extract_answer(text), extraction_config=configs, parsing_timeout=None)
        scores.append(float(bool(pred) and verify(gold, pred, timeout_seconds=None)))
    return scores


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - start) * 1000, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    before, after, same = [], [], True
    math_verify_loop(*completions(1, 2, seed=10_000))  # import and warm sympy for both sides
    for round_ in range(args.rounds):
        texts, answers = completions(args.groups, args.group_size, seed=round_)
        ms_before, slow = timed(math_verify_loop, texts, answers)
        ms_after, fast = timed(accuracy, texts, answers)
        before.append(ms_before)
        after.append(ms_after)
        same = same and slow == fast
    n = args.groups * args.group_size
    result = {
        "benchmark": "reward_accuracy",
        "completions_per_call": n,
        "rounds": args.rounds,
        "ms_per_call_before": statistics.median(before),
        "ms_per_call_after": statistics.median(after),
        "speedup": statistics.median(before) / statistics.median(after),
        "same_scores": same,
        "machine": machine(),
    }
    print(f"{'accuracy reward, ' + str(n) + ' completions':<40} {'ms (median)':>12}")
    print(f"{'math-verify on every item (before)':<40} {result['ms_per_call_before']:>12.1f}")
    print(f"{'plain numbers exact, parses cached':<40} {result['ms_per_call_after']:>12.1f}")
    print(f"speedup {result['speedup']:.0f}x; same scores: {same}")
    write_results(RESULTS_DIR / "reward_accuracy.json", result)


if __name__ == "__main__":
    main()

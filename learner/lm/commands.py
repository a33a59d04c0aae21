"""`rlfleet dpo-data` (arithmetic preference pairs for a DPO run) and `rlfleet ask` (a run's
answer to a prompt); entry points in ``rlfleet.commands``. Imports no torch: the CLI loads every
command to build its help."""

from __future__ import annotations

import argparse
import json

from learner.lm.dpo_data import generate_pairs
from services.commands import Command
from services.errors import ConfigError


def _dpo_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="JSONL file to write (a job: {kind: dpo}'s data or eval_data)")
    parser.add_argument("--count", type=int, default=1000, help="pairs to write (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--split", default="train", help="train, eval, ... (each split has different prompts)"
    )
    parser.add_argument("--digits", type=int, default=2, help="operand digits (default 2)")
    parser.add_argument(
        "--task",
        choices=("arith", "shapes"),
        default="arith",
        help="arith (text) or shapes (questions about images, written as PNG files in "
        "OUT's folder, under <OUT's name>-images/)",
    )
    parser.add_argument(
        "--question",
        default="mixed",
        help="shapes: largest_colour, count_circles, square_side or mixed (default)",
    )


def _dpo_data(args: argparse.Namespace) -> int:
    if args.count < 1 or args.digits < 1:
        raise ConfigError("--count and --digits must be at least 1")
    written = generate_pairs(
        args.out, args.task, args.count, split=args.split, seed=args.seed, digits=args.digits,
        question=args.question,
    )  # fmt: skip
    print(f"wrote {written} pairs to {args.out}")
    return 0


DPO_DATA = Command(
    "write DPO preference pairs (prompt, correct answer chosen, a wrong one rejected) as JSONL "
    "for job: {kind: dpo}: arithmetic, or questions about images (--task shapes)",
    _dpo_data_args,
    _dpo_data,
)


def _ask_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a run directory, a run name under runs/, a run config, a checkpoint folder or a "
        "final/ folder (a run still training answers from its latest checkpoint)",
    )
    parser.add_argument("prompt", help="the user's message")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled answer")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampled answer")
    parser.add_argument("--json", action="store_true", help="print the answers as JSON")


def _ask(args: argparse.Namespace) -> int:
    from learner.lm.ask import ask

    answer = ask(
        args.source,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(answer))
    else:
        print(f"{answer['source']}\ngreedy:  {answer['greedy']}\nsampled: {answer['sampled']}")
    return 0


ASK = Command(
    "a language-model run's answer to a prompt (greedy and sampled), from its final model or "
    "latest checkpoint",
    _ask_args,
    _ask,
)

"""`rlfleet dpo-data` (entry point in ``rlfleet.commands``): arithmetic preference pairs for a
DPO run. Imports no torch: the CLI loads every command to build its help."""

from __future__ import annotations

import argparse

from learner.lm.dpo_data import arith_pairs, write_pairs
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


def _dpo_data(args: argparse.Namespace) -> int:
    if args.count < 1 or args.digits < 1:
        raise ConfigError("--count and --digits must be at least 1")
    pairs = arith_pairs(args.count, seed=args.seed, split=args.split, digits=args.digits)
    print(f"wrote {write_pairs(args.out, pairs)} pairs to {args.out}")
    return 0


DPO_DATA = Command(
    "write arithmetic DPO preference pairs (prompt, correct answer chosen, a near miss "
    "rejected) as JSONL for job: {kind: dpo}",
    _dpo_data_args,
    _dpo_data,
)

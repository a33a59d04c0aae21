"""`rlfleet init-model` (entry point in ``rlfleet.commands``): a small local Qwen2 model and its
tokenizer, for runs without a model hub. Cheap to import: torch loads in the handler."""

from __future__ import annotations

import argparse

from services.commands import Command
from services.errors import ConfigError


def _init_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="folder to write the model and tokenizer to")
    parser.add_argument("--size", default="tiny", help="tiny (~1M params), small, base100m")
    parser.add_argument("--generator", default="arith", help="dataset generator for the tokenizer")
    parser.add_argument("--seed", type=int, default=0)


def _init_model(args: argparse.Namespace) -> int:
    from common.models import MODEL_SIZES, init_model

    if args.size not in MODEL_SIZES:
        raise ConfigError(f"--size: unknown size {args.size!r}; known: {', '.join(MODEL_SIZES)}")
    out = init_model(
        args.out_dir, size=args.size, dataset={"generator": args.generator}, seed=args.seed
    )
    print(f"wrote {out}")
    return 0


INIT_MODEL = Command(
    "create a small Qwen2 model and tokenizer on disk (no model hub)", _init_model_args, _init_model
)

"""The learner's `rlfleet` subcommands (entry points in ``rlfleet.commands``). Cheap to import:
torch and transformers load inside the handlers."""

from __future__ import annotations

import argparse

from services.cli import Command


def _dpo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="DPO config YAML (top level: learner.lm.dpo.DPOSettings)")


def _dpo(args: argparse.Namespace) -> int:
    from learner.lm.dpo import run_config

    return run_config(args.config)


DPO = Command("offline DPO on (prompt, chosen, rejected) JSONL pairs", _dpo_args, _dpo)

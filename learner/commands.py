"""The learner's `rlfleet` subcommands (entry points in ``rlfleet.commands``). Cheap to import:
torch and transformers load inside the handlers."""

from __future__ import annotations

import argparse

from services.cli import Command


def _dpo_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="JSONL file to write (a job: {kind: dpo}'s data or eval_data)")
    parser.add_argument("--count", type=int, default=1000, help="pairs to write (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument(
        "--split", default="train", help="train, eval, ... (each split has different prompts)"
    )
    parser.add_argument("--digits", type=int, default=2, help="operand digits (default 2)")


def _dpo_data(args: argparse.Namespace) -> int:
    from learner.lm.dpo_data import arith_pairs, write_pairs
    from services.errors import ConfigError

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


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a run directory, a run name under runs/, a run config (.yaml), a checkpoint folder "
        "(checkpoints/ or one tag in it) or a final/ folder",
    )
    parser.add_argument("out", help="the folder to write (must not exist or be empty)")
    parser.add_argument(
        "--quantize",
        choices=("w8a8", "w4a16", "w4a16-awq"),
        help="language models: quantize with llmcompressor into a compressed-tensors checkpoint "
        "vLLM loads (W8A8-INT8; W4A16 GPTQ group 128; W4A16 AWQ asymmetric), calibrated on the "
        "run's prompts; creates .venv-quant on first use",
    )
    parser.add_argument(
        "--config", help="the run config, when it is not the run directory's config.yaml"
    )
    parser.add_argument(
        "--calibration-dataset",
        help="prompts to calibrate on instead of the run's dataset: a spec such as "
        "'{generator: arith, digits: 1}' or a .jsonl file",
    )
    parser.add_argument(
        "--calibration-samples", type=int, default=256, help="calibration prompts (default 256)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace OUT when it holds an earlier export"
    )
    parser.add_argument("--json", action="store_true", help="print the manifest (less files)")


def _export(args: argparse.Namespace) -> int:
    from learner.export import main_export

    return main_export(args)


EXPORT = Command(
    "export a run: a Hugging Face folder (LoRA merged, optionally quantized) for language models, "
    "ONNX for game policies",
    _export_args,
    _export,
)

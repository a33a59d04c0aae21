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

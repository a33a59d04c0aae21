"""`rlfleet export` (entry point in ``rlfleet.commands``): its arguments and its handler. Imports
no torch: the CLI loads every command to build its help, and the export loads what it needs."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from learner.export import CALIBRATION_SAMPLES, export
from learner.export.quantize import SCHEMES
from services.commands import Command
from services.errors import ConfigError
from services.yaml_loading import YamlTooLarge
from services.yaml_loading import safe_load as safe_load_yaml


def _export_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a run directory, a run name under runs/, a run config (.yaml), a checkpoint folder "
        "(checkpoints/ or one tag in it) or a final/ folder",
    )
    parser.add_argument("out", help="the folder to write (must not exist or be empty)")
    parser.add_argument(
        "--quantize",
        choices=SCHEMES,
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
        "--calibration-samples",
        type=int,
        default=CALIBRATION_SAMPLES,
        help=f"calibration prompts (default {CALIBRATION_SAMPLES})",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace OUT when it holds an earlier export"
    )
    parser.add_argument("--json", action="store_true", help="print the manifest (less files)")


def _calibration_dataset(text: str | None) -> dict[str, Any] | None:
    """``--calibration-dataset``: a .jsonl file, or a dataset spec written as YAML."""
    if not text:
        return None
    try:
        dataset = {"jsonl": text} if text.endswith(".jsonl") else safe_load_yaml(text)
    except (yaml.YAMLError, YamlTooLarge) as exc:
        raise ConfigError(f"--calibration-dataset {text[:80]!r}: not valid YAML: {exc}") from None
    if not isinstance(dataset, dict):
        raise ConfigError(
            f"--calibration-dataset {text!r}: expected a dataset spec such as "
            "'{generator: arith, digits: 1}' or a .jsonl file"
        )
    return dataset


def _export(args: argparse.Namespace) -> int:
    result = export(
        args.source,
        args.out,
        quantize=args.quantize,
        config=args.config,
        calibration_dataset=_calibration_dataset(args.calibration_dataset),
        calibration_samples=args.calibration_samples,
        force=args.force,
    )
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2))
    return 0


EXPORT = Command(
    "export a run: a Hugging Face folder (LoRA merged, optionally quantized) for language models, "
    "ONNX for game policies",
    _export_args,
    _export,
)

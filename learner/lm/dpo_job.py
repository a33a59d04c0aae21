"""Offline DPO as a job kind: `job: {kind: dpo, model_path: ..., data: ...}` in a run file.

The knobs (``DPOSettings``, also the settings of the ``dpo_learner`` service it expands into)
are TRL's names where TRL has one (``beta``, ``loss_type``, ``label_smoothing``). The job
expands into one service, the run's main one, that trains on the preference pairs and writes
``checkpoints/``, ``tensorboard/`` and ``final/`` into the run directory (learner/lm/dpo.py).
``prepare`` creates the model with init-model when asked to and checks that the pair files exist
(``rlfleet dpo-data`` writes arithmetic pairs). Pure pydantic: importing this does not import
torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from learner.lm.settings import InitModel, LMTrainingKnobs, LoraSettings, check_freeze
from learner.settings import (
    DeviceKnob,
    PrecisionKnob,
    ZeroStageKnob,
    check_precision,
    knob,
)
from services.config import StrictModel
from services.errors import ConfigError
from services.registry import JobSpec

__all__ = ["DPO_JOB", "DPOJobSettings", "DPOSettings", "expand", "prepare"]

SERVICE_KIND = "dpo_learner"


class DPOSettings(StrictModel):
    """Offline DPO (Rafailov et al. 2023) of a causal LM on (prompt, chosen, rejected) pairs."""

    model_path: Path = Field(
        description="Hugging Face model folder to start from; also the reference model"
    )
    data: Path = Field(
        description="training pairs, JSONL {prompt, chosen, rejected} per line (rlfleet dpo-data)"
    )
    eval_data: Path | None = Field(
        default=None, description="pairs scored before and after training (null: no evaluation)"
    )
    max_length: int = Field(
        default=512, ge=2, description="prompt + completion tokens; longer completions are cut"
    )
    beta: float = Field(
        default=0.1, gt=0, description="strength of the implicit KL to the reference"
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="conservative DPO: assumed probability a pair's labels are flipped (sigmoid)",
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        default="sigmoid",
        description="sigmoid = DPO; ipo = IPO (length-averaged log-probs); hinge = SLiC",
    )
    epochs: int = Field(default=1, ge=1, description="passes over data, reshuffled each time")
    batch_size: int = Field(default=8, ge=1, description="pairs per optimizer step on each rank")
    learning_rate: float = Field(
        default=1e-6, gt=0, description="AdamW learning rate (TRL's default for full tuning)"
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="linear learning-rate warm-up steps, then constant"
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW's decoupled weight decay")
    gradient_clipping: float | None = Field(
        default=1.0, gt=0, description="global gradient-norm clip (null: off)"
    )
    packing: bool = knob(LMTrainingKnobs, "packing")
    freeze_vision_encoder: bool = knob(LMTrainingKnobs, "freeze_vision_encoder")
    freeze_aligner: bool = knob(LMTrainingKnobs, "freeze_aligner")
    lora: LoraSettings | None = Field(
        default=None, description="train LoRA adapters only, merged into final/ (null: full)"
    )
    precision: PrecisionKnob = "fp32"
    zero_stage: ZeroStageKnob = 0
    device: DeviceKnob = "auto"
    cache_dir: Path | None = Field(
        default=None, description="DeepSpeed's JIT-built ops cache (default: its own)"
    )
    seed: int = Field(default=0, description="LoRA initialisation and the shuffling order")
    log_every: int = Field(
        default=10, ge=1, description="optimizer steps between progress records and metrics"
    )
    checkpoint_every: int = Field(
        default=50, ge=1, description="optimizer steps between checkpoints (a stopped run resumes)"
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="newest checkpoints kept")

    @model_validator(mode="after")
    def _consistent(self) -> DPOSettings:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing applies to loss_type 'sigmoid' only")
        check_precision(self.precision, self.device)
        check_freeze(
            self.model_path,
            freeze_vision_encoder=self.freeze_vision_encoder,
            freeze_aligner=self.freeze_aligner,
        )
        return self


class PairsKnob(StrictModel):
    """Preference pairs `rlfleet up` writes (as `rlfleet dpo-data` does) when the job's data or
    eval_data file is missing."""

    task: Literal["arith", "shapes"] = Field(
        default="arith", description="arith (text) or shapes (questions about images)"
    )
    count: int = Field(default=512, ge=1, description="training pairs (data)")
    eval_count: int = Field(default=128, ge=1, description="held-out pairs (eval_data)")
    question: str = Field(
        default="mixed", description="shapes: largest_colour, count_circles, square_side, mixed"
    )
    digits: int = Field(default=2, ge=1, description="arith: operand digits")


class DPOJobSettings(DPOSettings):
    """Offline DPO of a causal LM on preference pairs (one learner service, no sampling).

    TRL's names where TRL has one (beta, loss_type, label_smoothing); make arithmetic pairs with
    `rlfleet dpo-data OUT.jsonl --count N`."""

    aliases: ClassVar[Mapping[str, str]] = {
        "model": "model_path",
        "model_name": "model_path",
        "model_name_or_path": "model_path",
        "dataset": "use data: pairs.jsonl (JSONL {prompt, chosen, rejected})",
        "train_dataset": "data",
        "eval_dataset": "eval_data",
        "num_train_epochs": "epochs",
        "per_device_train_batch_size": "batch_size",
        "train_batch_size": "batch_size",
        "lr": "learning_rate",
        "max_grad_norm": "gradient_clipping",
        "warmup": "warmup_steps",
        "save_steps": "checkpoint_every (in optimizer steps)",
        "logging_steps": "log_every",
        "kl_beta": "beta",
        "max_prompt_length": "max_length (prompt + completion tokens)",
        "peft_config": "lora",
        "use_peft": "use lora: {r: ..., alpha: ...}",
        "bf16": "use precision (fp32 | bf16 | fp16)",
        "output_dir": "not a knob: a run writes into its run directory (run: {name, dir})",
    }

    init_model: InitModel | None = Field(
        default=None,
        description="size of the model init-model creates at model_path when missing (null: never)",
    )
    restarts: int = Field(default=2, ge=0, description="restarts of the learner before it fails")
    make_pairs: PairsKnob | None = Field(
        default=None,
        description="write data and eval_data (the eval split) with dpo-data's generators when "
        "they are missing (null: they must exist)",
    )

    @model_validator(mode="after")
    def _model_known(self) -> DPOJobSettings:
        if not self.model_path.exists() and self.init_model is None:
            raise ValueError(
                f"model_path {self.model_path} does not exist and init_model is null (make one "
                f"with `rlfleet init-model {self.model_path}` or set init_model: tiny)"
            )
        return self


def expand(settings: DPOJobSettings, run_name: str) -> list[dict[str, Any]]:
    """One service: the DPO learner, main (the run ends when it does)."""
    learner = settings.model_dump(mode="json", include=set(DPOSettings.model_fields))
    return [
        {
            "name": "dpo",
            "service": SERVICE_KIND,
            "main": True,
            "restarts": settings.restarts,
            "settings": learner,
        }
    ]


def prepare(settings: DPOJobSettings, run_dir: Path) -> None:
    """Write missing pair files when make_pairs says how, check every pair file line by line (a
    bad line fails `rlfleet up` before the learner starts, naming file:line), then create the
    model with init-model when asked to (idempotent)."""
    from common.datasets import DatasetSpecError
    from learner.lm.dpo_data import generate_pairs, load_pairs

    made = settings.make_pairs
    for key, split in (("data", "train"), ("eval_data", "eval")):
        path = getattr(settings, key)
        if path is None:
            continue
        if not Path(path).is_file() and made is not None:
            count = made.count if split == "train" else made.eval_count
            print(f"dpo-data: writing {count} {made.task} pairs to {path}", flush=True)
            generate_pairs(
                path, made.task, count, split=split, seed=settings.seed, digits=made.digits,
                question=made.question,
            )  # fmt: skip
        if not Path(path).is_file():
            raise ConfigError(
                f"job.{key}: {path} does not exist (arithmetic pairs: "
                f"`rlfleet dpo-data {path} --count 512`)"
            )
        try:
            load_pairs(path)
        except DatasetSpecError as exc:
            raise ConfigError(f"job.{key}: {exc}") from None
    s = settings
    if (s.model_path / "config.json").is_file() or s.init_model is None:
        return
    from learner.lm.jobs import create_model

    create_model(s.model_path, s.init_model, seed=s.seed)


DPO_JOB = JobSpec(
    kind="dpo", settings=DPOJobSettings, expand=expand, prepare=prepare, watch="prompt"
)

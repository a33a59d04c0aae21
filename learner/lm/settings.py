"""Settings of the `lm_learner` kind (YAML `settings:` or RLFLEET_LM_LEARNER__<KEY>).

Pure pydantic (no torch at import): the launcher validates a run with this before anything
starts. The algorithm is a named preset (``learner.algos.presets``) plus overrides, checked at
validation against the typed registries (imported then), so a name of the wrong family (``gae``
as the advantage of a GRPO preset) fails here, naming the field. The knobs an LM job sets too
are declared once, in ``LMTrainingKnobs``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from learner.settings import (
    DeviceKnob,
    NonfiniteGuard,
    PrecisionKnob,
    ZeroStageKnob,
    check_precision,
)
from services.config import ServiceRef, StrictModel, unknown_key

__all__ = [
    "ALGO_ALIASES",
    "LEARNER_SESSION_ENVS",
    "EvalSettings",
    "InitModel",
    "LMLearnerSettings",
    "LMTrainingKnobs",
    "LearnerTextEnv",
    "LoraSettings",
    "SFTSettings",
    "check_freeze",
    "check_micro_batch_size",
    "check_preset",
    "check_preset_name",
    "is_vision_model",
]

# What init-model can create at a missing model_path: a text model's size, or tiny-vision.
InitModel = Literal["tiny", "small", "base100m", "tiny-vision"]


def check_preset_name(name: str) -> str:
    """``name`` if ``PRESETS`` has it, else ``ValueError`` listing the known ones (a built-in
    name is checked without importing torch)."""
    from learner.algos.presets import builtin_preset
    from learner.algos.registry import PRESETS

    if builtin_preset(name) is not None:
        return name
    try:
        PRESETS.get(name)
    except LookupError as exc:  # UnknownNameError lists the known ones
        raise ValueError(str(exc)) from None
    return name


def check_micro_batch_size(size: int | None, minibatch_size: int | None) -> int | None:
    """``size`` unless it exceeds ``minibatch_size`` (None: that failed already): micro-batches
    split a minibatch (a last one may be smaller)."""
    if size is not None and minibatch_size is not None and size > minibatch_size:
        raise ValueError(
            f"micro_batch_size ({size}) must be at most minibatch_size ({minibatch_size}): "
            "micro-batches split each minibatch"
        )
    return size


def is_vision_model(model_path: Path) -> bool | None:
    """Whether the Hugging Face folder ``model_path`` holds a vision-language model (its
    config.json has a ``vision_config``); None when there is no config.json to read yet."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return "vision_config" in json.loads(config.read_text())


def check_freeze(model_path: Path, **flags: bool) -> None:
    """``ValueError`` naming the first ``freeze_*`` knob that is set for a text model (a folder
    not there yet is checked when the learner loads it)."""
    for name, value in flags.items():
        if value and is_vision_model(model_path) is False:
            raise ValueError(
                f"{name}: {model_path} is a text model (its config.json has no vision_config): "
                "there is no vision part to freeze"
            )


def check_preset(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` if the preset ``name`` with them applied validates, else ``ValueError``
    naming the bad override or the field holding a name of the wrong family."""
    from learner.algos.presets import builtin_preset, resolve_preset

    if not overrides and builtin_preset(name) is not None:
        return overrides  # as registered: tests resolve every built-in preset
    try:
        resolve_preset(name, **overrides)
    except LookupError as exc:  # UnknownNameError / WrongFamilyError: "field: ..."
        raise ValueError(str(exc)) from None
    return overrides


class LoraSettings(StrictModel):
    """peft LoRA adapters on the attention and MLP projections."""

    r: int = Field(default=8, ge=1, description="rank of the adapters")
    alpha: float = Field(
        default=16.0, gt=0, description="scale: updates are multiplied by alpha / r"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(
        description="module names that get adapters",
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )


class SFTSettings(StrictModel):
    """Supervised warm start on the dataset's expert solutions, before the first version."""

    dataset: dict[str, Any] = Field(default_factory=lambda: {"generator": "arith"})
    steps: int = Field(
        default=200, ge=0, description="supervised warm-start steps before RL (0: no SFT)"
    )
    batch_size: int = Field(default=32, ge=1, description="examples per SFT step")
    learning_rate: float = Field(default=1e-3, gt=0, description="SFT learning rate")


class EvalSettings(StrictModel):
    """Greedy accuracy on held-out prompts (a generator's "eval" split, or a file of their own),
    scored by the reward service, at the warm-started version and every ``every`` updates."""

    dataset: dict[str, Any] = Field(
        default_factory=lambda: {"generator": "arith"},
        description="dataset spec of the held-out prompts: a generator (its `split`) or a JSONL "
        "file of rows not trained on",
    )
    split: str = Field(
        default="eval",
        description="split of a generator to evaluate on (any but train: prompts a generator "
        "never trains on); a JSONL file has none",
    )
    # Checked once, at the first evaluation: a warning counts the eval prompts it also holds.
    train_dataset: dict[str, Any] | None = Field(
        default=None,
        description="the rollout drivers' dataset, to warn when eval prompts are among its "
        "prompts (null: not checked)",
    )
    count: int = Field(default=200, ge=1)
    every: int = Field(default=10, ge=1, description="updates between evaluations")
    max_tokens: int = Field(default=16, ge=1)
    reward: str = "accuracy"  # reward function whose mean is the accuracy
    batch_size: int = Field(default=64, ge=1)


# Other tools' names for preset fields, inside `algo: {...}`.
ALGO_ALIASES = {
    "beta": "kl_beta",
    "kl_coef": "kl_beta",
    "kl_coeff": "kl_beta",
    "epsilon": "use loss_kwargs: {clip_low: ...} (the ratio clip range)",
    "epsilon_high": "use loss_kwargs: {clip_high: ...}",
    "entropy_coeff": "entropy_coef",
    "dynamic_sample": "dynamic_sampling",
}


class LMTrainingKnobs(StrictModel):
    """The knobs an LM job and the LM learner share, declared here once (type, default, bounds,
    help, checks): both models inherit them, and the job's expand copies them to the learner by
    name."""

    preset: str = Field(
        default="grpo",
        description="algorithm preset (PRESETS name: grpo, dapo, dr_grpo, gspo, sapo, cispo, "
        "rloo, ...); a job's kind sets it",
    )
    # Validated with the preset (after it: fields validate in order).
    algo: dict[str, Any] = Field(
        default_factory=dict,
        validate_default=True,
        description="preset field overrides (learner.algos.presets.Preset fields), e.g. "
        "{kl_beta: 0.04, loss_kwargs: {clip_high: 0.28}}",
    )
    model_path: Path = Field(
        description="Hugging Face model folder the learner trains and samplers serve "
        "(`rlfleet init-model` makes one)"
    )
    groups_per_update: int = Field(
        default=8,
        ge=1,
        description="prompt groups per update (after filters); batch = it x group_size completions",
    )
    total_updates: int = Field(
        default=100, ge=1, description="learner updates (optimizer phases) to train for"
    )
    learning_rate: float = Field(default=1e-4, gt=0, description="RL optimizer learning rate")
    epochs: int = Field(default=1, ge=1, description="passes over each update's batch")
    minibatch_size: int = Field(
        default=64, ge=1, description="sequences (completions) per optimizer step"
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="sequences per forward/backward pass, at most minibatch_size: gradients "
        "accumulate into one optimizer step per minibatch, same loss, less activation memory "
        "(null: the whole minibatch)",
    )
    packing: bool = Field(
        default=False,
        description="pack each forward pass's sequences end to end into rows of the model's "
        "context length (own positions, block-diagonal attention): the same loss and gradients "
        "on less padding",
    )
    freeze_vision_encoder: bool = Field(
        default=False,
        description="a vision-language model's vision encoder does not train: no gradients, "
        "not in the optimizer, never sent again after the first weight version (a text model: "
        "an error)",
    )
    freeze_aligner: bool = Field(
        default=False,
        description="a vision-language model's aligner (the connector projecting image "
        "features into the text model) does not train, as freeze_vision_encoder (a text "
        "model: an error)",
    )
    # How the older groups kept are corrected: the preset's old_logp (algo: {old_logp: ...}).
    max_policy_lag: int = Field(
        default=1,
        ge=0,
        description="drop groups sampled more than this many versions ago (0: on-policy only)",
    )
    lora: LoraSettings | None = Field(
        default=None, description="LoRA adapters (null: full fine-tuning)"
    )
    checkpoint_every: int = Field(
        default=10, ge=1, description="updates between learner checkpoints"
    )
    zero_stage: ZeroStageKnob = 0
    precision: PrecisionKnob = "fp32"
    device: DeviceKnob = "auto"
    seed: int = Field(default=1, ge=0, description="base seed (sampler i's engine gets seed + i)")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        return check_preset_name(name)

    @field_validator("algo")
    @classmethod
    def _valid_overrides(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "preset" not in info.data:  # the preset name failed already
            return overrides
        from learner.algos.presets import Preset

        for key in overrides:  # reported at algo.<key>'s own line
            if key not in Preset.model_fields:
                raise unknown_key(key, list(Preset.model_fields), ALGO_ALIASES)
        return check_preset(info.data["preset"], overrides)

    @field_validator("micro_batch_size")
    @classmethod
    def _splits_minibatch(cls, size: int | None, info: ValidationInfo) -> int | None:
        return check_micro_batch_size(size, info.data.get("minibatch_size"))

    @model_validator(mode="after")
    def _trainable_precision(self) -> LMTrainingKnobs:
        check_precision(self.precision, self.device)
        check_freeze(
            self.model_path,
            freeze_vision_encoder=self.freeze_vision_encoder,
            freeze_aligner=self.freeze_aligner,
        )
        return self


# Envs of one learner session on the env server: demonstrations and evaluations go this many
# episodes at a time (the job's env server allows at least this many per session).
LEARNER_SESSION_ENVS = 32


class LearnerTextEnv(StrictModel):
    """A multi-turn run's text environment, for the learner's own episodes on its env server:
    SFT on the env's expert demonstrations (its train split) and greedy evaluations (its eval
    split, the mean episode return as eval/accuracy). The rollout drivers play the same env."""

    env_id: str = Field(min_length=1)
    env_server: ServiceRef  # EnvService instance name or host:port
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the env's arguments, split aside
    max_turns: int = Field(default=8, ge=1)  # model turns per evaluated episode
    max_total_tokens: int = Field(default=1024, ge=16)  # prompt and every turn, per episode
    startup_timeout_s: float = Field(default=300.0, gt=0)  # wait this long for the env server

    @field_validator("kwargs")
    @classmethod
    def _no_split(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "split" in kwargs:
            raise ValueError(
                "kwargs: split is set by the learner (train for SFT, eval to evaluate)"
            )
        return kwargs


class LMLearnerSettings(LMTrainingKnobs, NonfiniteGuard):
    """The language-model learner (GRPO family); see docs/internals.md, "Language-model RL"."""

    max_grad_norm: float | None = Field(default=1.0, gt=0)
    sft: SFTSettings | None = None
    eval: EvalSettings | None = None
    reward_service: ServiceRef | None = None  # scores evaluations; required with eval
    # Multi-turn: SFT on the env's demonstrations and evaluations on its episodes instead of
    # the datasets of `sft` and `eval` (whose steps, counts and intervals still apply).
    env: LearnerTextEnv | None = None

    keep_checkpoints: int = Field(default=2, ge=1)
    keep_versions: int = Field(default=4, ge=1)
    ack_wait_s: float = Field(default=20.0, gt=0)  # as the game learner's; LM updates are slower
    applied_window: int = Field(default=100_000, ge=1)
    cache_dir: Path | None = None  # see DeepSpeedSettings.cache_dir

    @model_validator(mode="after")
    def _consistent(self) -> LMLearnerSettings:
        if self.eval is not None and self.reward_service is None and self.env is None:
            raise ValueError("eval needs reward_service (the service that scores it)")
        return self

    @property
    def max_ack_pending(self) -> int:
        return (self.checkpoint_every + 2) * self.groups_per_update * 4 + 64

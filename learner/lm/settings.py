"""Settings of the `lm_learner` kind (YAML `settings:` or RLFLEET_LM_LEARNER__<KEY>).

Pure pydantic (no torch at import): the launcher validates a run with this before anything
starts. The algorithm is a named preset (``learner.algos.presets``) plus overrides, checked at
validation against the typed registries (imported then), so a name of the wrong family (``gae``
as the advantage of a GRPO preset) fails here, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from learner.settings import Device, Precision
from services.config import ServiceRef, StrictModel

__all__ = [
    "EvalSettings",
    "LMLearnerSettings",
    "LoraSettings",
    "SFTSettings",
    "check_micro_batch_size",
    "check_preset",
    "check_preset_name",
]


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

    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )


class SFTSettings(StrictModel):
    """Supervised warm start on the dataset's expert solutions, before the first version."""

    dataset: dict[str, Any] = Field(default_factory=lambda: {"generator": "arith"})
    steps: int = Field(default=200, ge=0)  # optimizer steps; 0 = no SFT
    batch_size: int = Field(default=32, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)


class EvalSettings(StrictModel):
    """Greedy accuracy on held-out prompts (the dataset's "eval" split), scored by the reward
    service, at the warm-started version and every ``every`` updates."""

    dataset: dict[str, Any] = Field(default_factory=lambda: {"generator": "arith"})
    split: str = "eval"
    count: int = Field(default=200, ge=1)
    every: int = Field(default=10, ge=1)  # updates between evaluations
    max_tokens: int = Field(default=16, ge=1)
    reward: str = "accuracy"  # reward function whose mean is the accuracy
    batch_size: int = Field(default=64, ge=1)


class LMLearnerSettings(StrictModel):
    """The language-model learner (GRPO family); see docs/internals.md, "Language-model RL"."""

    model_path: Path  # Hugging Face folder (`rlfleet init-model` makes one)
    preset: str = "grpo"  # PRESETS name: grpo, dapo, dr_grpo, gspo, sapo, cispo, rloo, ...
    # Preset field overrides, e.g. {kl_beta: 0.0, loss_kwargs: {clip_high: 0.3}}; validated
    # with the preset (after it: fields validate in order).
    algo: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    groups_per_update: int = Field(default=8, ge=1)  # prompts (groups) per update, after filters
    epochs: int = Field(default=1, ge=1)  # passes over each batch
    minibatch_size: int = Field(default=64, ge=1)  # sequences per optimizer step
    # Sequences per forward/backward pass: a minibatch's micro-batches accumulate gradients into
    # its one optimizer step, with the same loss; peak activation memory follows this. None: the
    # whole minibatch at once. At most minibatch_size.
    micro_batch_size: int | None = Field(default=None, ge=1)
    learning_rate: float = Field(default=1e-4, gt=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    total_updates: int = Field(default=100, ge=1)
    # Groups sampled by a version older than this many versions are dropped. 0 = on-policy only.
    # How the older ones kept are corrected: the preset's old_logp (algo: {old_logp: ...}).
    max_policy_lag: int = Field(default=1, ge=0)
    lora: LoraSettings | None = None
    sft: SFTSettings | None = None
    eval: EvalSettings | None = None
    reward_service: ServiceRef | None = None  # scores evaluations; required with eval

    checkpoint_every: int = Field(default=10, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)
    keep_versions: int = Field(default=4, ge=1)
    ack_wait_s: float = Field(default=20.0, gt=0)  # as the game learner's; LM updates are slower
    applied_window: int = Field(default=100_000, ge=1)
    zero_stage: int = Field(default=0, ge=0, le=3)
    precision: Precision = "fp32"
    device: Device = "auto"
    cache_dir: Path | None = None
    seed: int = 1

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        return check_preset_name(name)

    @field_validator("algo")
    @classmethod
    def _valid_overrides(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "preset" not in info.data:  # the preset name failed already
            return overrides
        return check_preset(info.data["preset"], overrides)

    @field_validator("micro_batch_size")
    @classmethod
    def _splits_minibatch(cls, size: int | None, info: ValidationInfo) -> int | None:
        return check_micro_batch_size(size, info.data.get("minibatch_size"))

    @model_validator(mode="after")
    def _consistent(self) -> LMLearnerSettings:
        if self.eval is not None and self.reward_service is None:
            raise ValueError("eval needs reward_service (the service that scores it)")
        return self

    @property
    def max_ack_pending(self) -> int:
        return (self.checkpoint_every + 2) * self.groups_per_update * 4 + 64

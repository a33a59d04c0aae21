"""Settings of the `learner` kind, the game workload (YAML `settings:` or RLFLEET_LEARNER__<KEY>).

Pure pydantic, no torch at import: the launcher imports this to validate a run before anything
starts. Validating ``algo`` reads ``learner.algos``' presets; only a name that is not built in
(or installed plugins) loads the typed registries' functions, and torch with them.
Defaults are CleanRL's PPO defaults for CartPole, so the system and the PPO baseline match.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from common.policy_config import PolicyConfig
from learner.settings import (
    DeepSpeedSettings,
    Device,
    OptimizerSettings,
    Precision,
    check_device,
)
from services.config import ServiceRef, StrictModel

if TYPE_CHECKING:
    from learner.algos.presets import GamePreset

__all__ = ["LearnerSettings", "check_game_algo"]


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


class LearnerSettings(StrictModel):
    """The game-RL learner (PPO/A2C over rollout fragments); see docs/internals.md, "Game RL"."""

    # GAME_PRESETS name (ppo, a2c, or an rlfleet.algos plugin's): the advantage estimator and the
    # policy loss, whose hyperparameters come from the knobs below (ppo: clip_low = clip_coef).
    algo: str = "ppo"
    env_id: str = Field(default="CartPole-v1", min_length=1)
    env_kwargs: dict[str, Any] = Field(default_factory=dict)  # as the actors pass them
    # Where the observation/action spaces come from: the first reachable env server (a
    # one-env session, so the spaces are exactly what the actors step, plugins and wrappers
    # included); with none listed, gymnasium.make(env_id, **env_kwargs) in this process.
    env_servers: list[ServiceRef] = Field(default_factory=list)
    spaces_timeout_s: float = Field(default=120.0, gt=0)  # wait this long for an env server
    policy: PolicyConfig = PolicyConfig()

    total_timesteps: int = Field(default=500_000, ge=1)  # env steps consumed, then done
    # Done earlier once the mean return of the last `episode_window` episodes reaches this.
    target_return: float | None = None
    fragments_per_update: int = Field(default=4, ge=1)
    update_epochs: int = Field(default=4, ge=1)
    minibatch_size: int = Field(default=128, ge=1)
    learning_rate: float = Field(default=2.5e-4, gt=0)
    anneal_lr: bool = True  # linear to 0 over total_timesteps (CleanRL)
    gamma: float = Field(default=0.99, ge=0, le=1)
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    clip_coef: float = Field(default=0.2, gt=0)
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float | None = Field(default=0.5, gt=0)
    norm_adv: bool = True  # per minibatch, as CleanRL
    target_kl: float | None = Field(default=None, gt=0)
    bootstrap_truncated: bool = True  # bootstrap time limits from final_values
    # Values for GAE and the value-clipping anchor: True recomputes V(s_t), V(s_T) and V(final
    # observation) with the learner's current critic; False uses the actor's (behaviour) values.
    # Under policy lag the actor's values come from an older critic, so recomputing gives
    # advantages consistent with the critic being trained, for one batched forward pass. On
    # CartPole (baseline hyperparameters, 8 seeds) it reached a mean return of 475 in 23% fewer
    # env steps at lag 1 (23.8k vs 31.0k) and 17% fewer at lag 3 (28.3k vs 34.1k). At lag 0 both
    # give the same values. Fragments without values are always recomputed.
    recompute_values: bool = True
    # Fragments older than this many versions are dropped (acked, counted). 0 = on-policy only.
    max_policy_lag: int = Field(default=1, ge=0)

    checkpoint_every: int = Field(default=10, ge=1)  # updates between checkpoints
    keep_checkpoints: int = Field(default=2, ge=1)
    keep_versions: int = Field(default=4, ge=1)  # weight versions the WeightService keeps
    # Unacked fragments come back this long after a crash; held ones get in_progress() every
    # ack_wait_s / 3 so they are not redelivered while the learner holds them. Short, so that a
    # restarted learner gets what its predecessor applied after its last checkpoint back before
    # it has trained on much newer data (with 30 s a short run could end first, leaving them
    # unapplied); a spurious redelivery is harmless (applied ids are deduplicated).
    ack_wait_s: float = Field(default=8.0, gt=0)
    applied_window: int = Field(default=100_000, ge=1)  # fragment ids remembered for dedupe
    episode_window: int = Field(default=20, ge=1)  # episodes in charts/episodic_return

    zero_stage: int = Field(default=0, ge=0, le=3)
    precision: Precision = "fp32"
    device: Device = "auto"
    cache_dir: Path | None = None  # see DeepSpeedSettings.cache_dir
    seed: int = 1
    # Data-parallel DeepSpeed ranks (learner.ranks). >1 without a launcher's WORLD_SIZE: this
    # process is rank 0 and starts the others on this host; under torchrun (or any launcher
    # setting RANK/WORLD_SIZE) the launcher's world counts and this must be 1 or equal it.
    ranks: int = Field(default=1, ge=1)
    # A rank waiting this long for rank 0 (which sends a heartbeat while it waits on the bus)
    # gives up: a lost rank 0 never leaves the others hanging.
    rank_timeout_s: float = Field(default=120.0, gt=0)

    @field_validator("algo")
    @classmethod
    def _known_algo(cls, name: str) -> str:
        return check_game_algo(name)

    @field_validator("device")
    @classmethod
    def _available_device(cls, device: Device) -> Device:
        check_device(device)
        return device

    @model_validator(mode="after")
    def _consistent(self) -> LearnerSettings:
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision 'fp16' needs device 'cuda' (DeepSpeed has no CPU fp16)")
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

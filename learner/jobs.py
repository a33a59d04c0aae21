"""Game-RL jobs (`job: {kind: ppo | a2c, ...}` in a run file).

A job is the user's view of a training run: the flat knobs CleanRL users know (`num_envs`,
`rollout_length`, `learning_rate`, ...) plus how many env servers and actors to spread them over.
It expands into ordinary service entries (env servers, the learner as the run's `main` service,
actors), which the run file could also spell out by hand. Pure pydantic: importing this does not
import torch; validating ``algo`` looks it up in ``learner.algos``' ``GAME_PRESETS``, lazily.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from learner.settings import check_game_algo
from services.config import StrictModel
from services.registry import JobSpec, get_service

__all__ = ["A2C_JOB", "PPO_JOB", "GameJobSettings"]


class GameJobSettings(StrictModel):
    """PPO/A2C over remote environment pools. Batch per update =
    fragments_per_update x rollout_length x num_envs transitions."""

    algo: str = "ppo"  # GAME_PRESETS name (LearnerSettings.algo): ppo, a2c, or a plugin's
    env_id: str = Field(min_length=1)
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    # How many env servers the run starts (env-0, env-1, ...), or the addresses (host:port) of
    # env servers that already run elsewhere.
    env_servers: int | list[str] = 1
    num_actors: int = Field(default=1, ge=1)
    num_envs: int = Field(default=8, ge=1)  # per actor
    rollout_length: int = Field(default=128, ge=1)  # steps per fragment
    total_timesteps: int = Field(default=500_000, ge=1)
    target_return: float | None = None  # stop early at this mean return (last 20 episodes)
    fragments_per_update: int | None = Field(default=None, ge=1)  # default: num_actors
    update_epochs: int = Field(default=4, ge=1)
    minibatch_size: int = Field(default=256, ge=1)
    learning_rate: float = Field(default=2.5e-4, gt=0)
    anneal_lr: bool = True
    gamma: float = Field(default=0.99, ge=0, le=1)
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    clip_coef: float = Field(default=0.2, gt=0)
    clip_vloss: bool = True
    ent_coef: float = Field(default=0.01, ge=0)
    vf_coef: float = Field(default=0.5, ge=0)
    max_grad_norm: float | None = Field(default=0.5, gt=0)
    norm_adv: bool = True
    target_kl: float | None = Field(default=None, gt=0)
    max_policy_lag: int = Field(default=1, ge=0)
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: Literal["tanh", "relu"] = "tanh"
    checkpoint_every: int = Field(default=10, ge=1)
    zero_stage: int = Field(default=0, ge=0, le=3)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["cpu", "cuda", "auto"] = "auto"
    seed: int = Field(default=1, ge=0)
    restarts: int = Field(default=3, ge=0)  # per service
    env_server: dict[str, Any] = Field(default_factory=dict)  # extra env_server settings

    @field_validator("algo")
    @classmethod
    def _known_algo(cls, name: str) -> str:
        return check_game_algo(name)

    @field_validator("env_servers")
    @classmethod
    def _servers(cls, value: int | list[str]) -> int | list[str]:
        if isinstance(value, int) and value < 1:
            raise ValueError("env_servers must be >= 1 (or a list of host:port addresses)")
        if isinstance(value, list):
            if not value:
                raise ValueError("env_servers must not be empty")
            bad = [v for v in value if ":" not in v]
            if bad:
                raise ValueError(f"external env servers must be host:port, got {bad}")
        return value

    @field_validator("env_id")
    @classmethod
    def _known_env(cls, env_id: str) -> str:
        # Env servers run this same install, so an id unknown here is unknown to them too. The
        # env server's own settings model checks it (found by kind, through the rlfleet.services
        # entry points: the learner does not import the env server).
        try:
            get_service("env_server").settings.model_validate({"preload": [env_id]})
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            raise ValueError(f"no env server hosts env id '{env_id}': {reason}") from None
        return env_id

    @model_validator(mode="after")
    def _batch(self) -> GameJobSettings:
        servers = self.env_servers if isinstance(self.env_servers, int) else len(self.env_servers)
        if self.num_envs < servers:
            raise ValueError(
                f"num_envs={self.num_envs} per actor is fewer than the {servers} env servers "
                "each actor spreads its envs over"
            )
        batch = self.batch_size
        if self.minibatch_size > batch:
            raise ValueError(
                f"minibatch_size={self.minibatch_size} exceeds the batch of {batch} transitions "
                "(fragments_per_update x rollout_length x num_envs)"
            )
        return self

    @property
    def batch_size(self) -> int:
        return (self.fragments_per_update or self.num_actors) * self.rollout_length * self.num_envs


def _env_server_names(settings: GameJobSettings) -> list[str]:
    if isinstance(settings.env_servers, list):
        return list(settings.env_servers)
    return [f"env-{i}" for i in range(settings.env_servers)]


def expand(settings: GameJobSettings, run_name: str) -> list[dict[str, Any]]:
    """Env servers first (actors and the learner need them healthy), then the learner (its
    WeightService must be up before actors ask for version 0), then the actors."""
    s = settings
    servers = _env_server_names(s)
    entries: list[dict[str, Any]] = []
    if isinstance(s.env_servers, int):
        for name in servers:
            env = {"preload": [s.env_id], **s.env_server}
            entry = {"name": name, "service": "env_server", "restarts": s.restarts}
            entries.append({**entry, "settings": env})
    policy = {"hidden_sizes": list(s.hidden_sizes), "activation": s.activation}
    fragments_per_update = s.fragments_per_update or s.num_actors
    learner: dict[str, Any] = {
        "algo": s.algo,
        "env_id": s.env_id,
        "env_kwargs": s.env_kwargs,
        "env_servers": servers[:1],
        "policy": policy,
        "total_timesteps": s.total_timesteps,
        "target_return": s.target_return,
        "fragments_per_update": fragments_per_update,
        "update_epochs": s.update_epochs,
        "minibatch_size": s.minibatch_size,
        "learning_rate": s.learning_rate,
        "anneal_lr": s.anneal_lr,
        "gamma": s.gamma,
        "gae_lambda": s.gae_lambda,
        "clip_coef": s.clip_coef,
        "clip_vloss": s.clip_vloss,
        "ent_coef": s.ent_coef,
        "vf_coef": s.vf_coef,
        "max_grad_norm": s.max_grad_norm,
        "norm_adv": s.norm_adv,
        "target_kl": s.target_kl,
        "max_policy_lag": s.max_policy_lag,
        "checkpoint_every": s.checkpoint_every,
        "zero_stage": s.zero_stage,
        "precision": s.precision,
        "device": s.device,
        "seed": s.seed,
    }
    entries.append(
        {"name": "learner", "service": "learner", "main": True, "restarts": s.restarts,
         "settings": learner}
    )  # fmt: skip
    for i in range(s.num_actors):
        # Actor i uses every server (its envs split over them), so load spreads evenly.
        actor = {
            "env_servers": servers,
            "env_id": s.env_id,
            "env_kwargs": s.env_kwargs,
            "num_envs": s.num_envs,
            "seed": s.seed,
            "actor_index": i,
            "rollout_length": s.rollout_length,
            "policy": "learner",
            "learner": "learner",
            # Each actor's share of an update: paces the actor to one update ahead.
            "fragments_per_version": -(-fragments_per_update // s.num_actors),
            "policy_config": policy,
            "device": "cpu",
        }
        entries.append(
            {"name": f"actor-{i}", "service": "game_actor", "restarts": s.restarts,
             "settings": actor}
        )  # fmt: skip
    return entries


PPO_JOB = JobSpec(kind="ppo", settings=GameJobSettings, expand=expand)


class A2CJobSettings(GameJobSettings):
    """A2C: the same knobs, one epoch over the whole batch by default."""

    algo: str = "a2c"
    update_epochs: int = Field(default=1, ge=1)


A2C_JOB = JobSpec(kind="a2c", settings=A2CJobSettings, expand=expand)

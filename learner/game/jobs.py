"""Game-RL jobs (`job: {kind: ppo | a2c | appo, ...}` in a run file).

A job is the user's view of a training run: the flat knobs CleanRL users know (`num_envs`,
`rollout_length`, `learning_rate`, ...) plus how many env servers and actors to spread them over.
It expands into ordinary service entries (env servers, the learner as the run's `main` service,
actors), which the run file could also spell out by hand. With `game:` the envs are an external
game's: the env servers host GameLink following the learner, and the game's command runs as
`process` services that connect to them, instead of actors. Pure pydantic: importing this does not
import torch, nor does validating ``algo`` (a built-in name: learner.game.settings.check_game_algo).

The training knobs are the learner's (learner.game.settings.GameTrainingKnobs, each declared
there once with its help text, which `rlfleet jobs ppo` prints); the settings model here adds the
knobs of the processes around it and the 70-line table of other tools' names for them, and the
actor and the `game:` expansions share all of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from learner.game.settings import GameTrainingKnobs, LearnerSettings
from learner.settings import knob
from services.config import StrictModel, Switch, error_at
from services.placement import own_cpu_for
from services.registry import JobSpec, get_service
from services.settings import address_problem

__all__ = [
    "A2C_JOB",
    "APPO_JOB",
    "MAX_ACTORS",
    "MAX_ENVS_PER_ACTOR",
    "MAX_ENV_SERVERS",
    "MAX_GAME_INSTANCES",
    "MAX_TOTAL_ENVS",
    "PPO_JOB",
    "GameJobSettings",
    "GameSettings",
]

# Upper bounds on the counts a job expands into: one process per actor and env server, and
# every env of every actor is a live session on an env server. Past these a typo (an extra
# zero) would try to start tens of thousands of processes rather than fail in validation.
MAX_ACTORS = 1024
MAX_ENV_SERVERS = 256
MAX_ENVS_PER_ACTOR = 4096
MAX_TOTAL_ENVS = 65_536  # num_actors x num_envs
MAX_GAME_INSTANCES = 256  # game processes (each one GameLink link or more)


class GameSettings(StrictModel):
    """An external game that plays through GameLink: its command runs as `process` services
    (game-0, game-1, ...), each told its env server by RLFLEET_GAME_LINK_ADDRESS."""

    command: list[str] = Field(
        min_length=1,
        description="argv of the game, e.g. [node, dist/examples/snake/main.js, --boards, 8]",
    )
    cwd: str | None = Field(
        default=None,
        description="folder to run it in, relative to the run file's folder (the default)",
    )
    env: dict[str, str | int | float] = Field(
        default_factory=dict,
        description="extra environment beside RLFLEET_GAME_LINK_ADDRESS and RLFLEET_RUN "
        "({address:<service>}, {run}, {run_dir} are replaced)",
    )
    instances: int = Field(
        default=1,
        ge=1,
        le=MAX_GAME_INSTANCES,
        description="game processes to run, spread over the env servers",
    )


class GameJobSettings(GameTrainingKnobs):
    """PPO/A2C over remote environment pools. Batch per update =
    fragments_per_update x rollout_length x num_envs transitions (with `game:`, x the agents
    of one game link instead of num_envs).

    The training knobs (algo to seed) are the learner's own declarations (GameTrainingKnobs),
    passed on by name; the rest say how many processes step the envs and how."""

    aliases: ClassVar[Mapping[str, str]] = {
        "env": "env_id",
        "env_name": "env_id",
        "gym_id": "env_id",
        "environment": "env_id",
        "n_envs": "num_envs",
        "num_envs_per_worker": "num_envs",
        "num_envs_per_env_runner": "num_envs",
        "num_workers": "use num_actors (actor processes), each stepping num_envs envs",
        "num_env_runners": "num_actors",
        "num_rollout_workers": "num_actors",
        "total_steps": "total_timesteps",
        "n_timesteps": "total_timesteps",
        "timesteps": "total_timesteps",
        "num_timesteps": "total_timesteps",
        "num_steps": "rollout_length",
        "n_steps": "rollout_length",
        "rollout_fragment_length": "rollout_length",
        "batch_size": "rlfleet's minibatch_size is the SGD minibatch; the rollout batch per update "
        "is num_actors x num_envs x rollout_length (fragments_per_update sets the first factor)",
        "train_batch_size": "the rollout batch is num_actors x num_envs x rollout_length "
        "(fragments_per_update sets the first factor); minibatch_size is the SGD minibatch",
        "num_minibatches": "set minibatch_size (transitions per SGD step) instead",
        "sgd_minibatch_size": "minibatch_size",
        "minibatch": "minibatch_size",
        "epochs": "update_epochs",
        "n_epochs": "update_epochs",
        "ppo_epochs": "update_epochs",
        "num_epochs": "update_epochs",
        "num_sgd_iter": "update_epochs",
        "lr": "learning_rate",
        "discount": "gamma",
        "discount_factor": "gamma",
        "lam": "gae_lambda",
        "lambda": "gae_lambda",
        "lambda_": "gae_lambda",
        "gae": "gae_lambda",
        "clip_range": "clip_coef",
        "clip_param": "clip_coef",
        "clip_epsilon": "clip_coef",
        "eps_clip": "clip_coef",
        "epsilon": "clip_coef",
        "entropy_coef": "ent_coef",
        "entropy_coeff": "ent_coef",
        "vf_loss_coeff": "vf_coef",
        "value_coef": "vf_coef",
        "grad_clip": "max_grad_norm",
        "normalize_advantage": "norm_adv",
        "beta": "game jobs have no KL penalty: ent_coef is the entropy bonus, target_kl stops "
        "an update early",
        "kl_coeff": "game jobs have no KL penalty: target_kl stops an update's epochs early",
        "kl_coef": "game jobs have no KL penalty: target_kl stops an update's epochs early",
        "net_arch": "hidden_sizes",
        "fcnet_hiddens": "hidden_sizes",
        "activation_fn": "activation",
        "gpu_ids": "device",
        "gpu": "device",
        "cuda": "use device (cpu | cuda | auto)",
        "num_gpus": "use device (cpu | cuda | auto); the learner uses one device",
        "use_gpu": "device",
        "torch_deterministic": "not a knob: runs are seeded by seed",
        "save_freq": "use checkpoint_every (in updates)",
        "checkpoint_freq": "use checkpoint_every (in updates)",
        "bf16": "use precision (fp32 | bf16 | fp16)",
        "fp16": "use precision (fp32 | bf16 | fp16)",
        "mixed_precision": "use precision (fp32 | bf16 | fp16)",
    }

    env_servers: int | list[str] = Field(
        default=1,
        description="env servers to start (env-0, env-1, ...), or host:port of running ones",
    )
    num_actors: int = Field(
        default=1,
        ge=1,
        le=MAX_ACTORS,
        description="actor processes stepping envs (one game_actor service each)",
    )
    num_envs: int = Field(
        default=8,
        ge=1,
        le=MAX_ENVS_PER_ACTOR,
        description="envs per actor, spread over the env servers",
    )
    rollout_length: int = Field(
        default=128,
        ge=1,
        description="env steps per fragment (per env) an actor sends to the learner",
    )
    double_buffer: Annotated[Literal["on", "off"], Switch] = Field(
        default="off",
        description="actors step half their envs while the policy infers on the other half "
        "(two sessions per env server, 2+ envs each); pays on hosts with cores to spare",
    )
    cpu_placement: Annotated[Literal["auto", "off"], Switch] = Field(
        default="auto",
        description="auto: with one learner rank and 2+ CPUs, `rlfleet up` runs the learner on "
        "a CPU of its own and every other service on the rest; off: the OS places them",
    )
    # Not the learner's knob of that name: unset, it follows num_actors (or game.instances).
    fragments_per_update: int | None = Field(
        default=None,
        ge=1,
        description="fragments (of all actors) per update; default: num_actors",
    )
    hidden_sizes: tuple[int, ...] = Field(
        default=(64, 64), description="widths of the policy and value MLPs' hidden layers"
    )
    activation: Literal["tanh", "relu"] = Field(
        default="tanh", description="hidden-layer activation"
    )
    learner_ranks: int = knob(LearnerSettings, "ranks")  # the learner's `ranks`
    restarts: int = Field(
        default=3, ge=0, description="restarts of each service before the run fails"
    )
    env_server: dict[str, Any] = Field(
        default_factory=dict,
        description="extra env_server settings, passed to every env server started",
    )
    game: GameSettings | None = Field(
        default=None,
        description="an external game (any language, through GameLink) instead of actors "
        "stepping env_id; env_id is then the id the game declares; num_envs/num_actors do not "
        "apply (the game's agents are the envs)",
    )

    @field_validator("env_servers")
    @classmethod
    def _servers(cls, value: int | list[str]) -> int | list[str]:
        if isinstance(value, int) and value < 1:
            raise ValueError("env_servers must be >= 1 (or a list of host:port addresses)")
        count = value if isinstance(value, int) else len(value)
        if count > MAX_ENV_SERVERS:
            raise ValueError(f"env_servers={count} is more than the {MAX_ENV_SERVERS} allowed")
        if isinstance(value, list):
            if not value:
                raise ValueError("env_servers must not be empty")
            bad = [v for v in value if ":" not in v]
            if bad:
                raise ValueError(f"external env servers must be host:port, got {bad}")
            for i, address in enumerate(value):
                problem = address_problem(address)
                if problem is not None:
                    raise error_at(problem, i)
        return value

    def _check_env_id(self) -> None:
        # Env servers run this same install, so an id unknown here is unknown to them too. The
        # env server's own settings model checks it (found by kind, through the rlfleet.services
        # entry points: the learner does not import the env server).
        # A reference (module:Name, path/to/file.py:Name) is imported and checked there too.
        env_id = self.env_id
        try:
            get_service("env_server").settings.model_validate({"preload": [env_id]})
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            if ":" in env_id:  # the reason names the reference already
                raise error_at(reason, "env_id") from None
            raise error_at(f"no env server hosts env id '{env_id}': {reason}", "env_id") from None

    def _check_game(self) -> None:
        """With ``game:`` the game brings the envs (its agents): actor knobs do not apply."""
        for name in ("num_envs", "num_actors"):
            if name in self.model_fields_set:
                raise error_at(
                    f"{name} does not apply with `game:`: the game's agents are the envs (each "
                    "game process declares how many it steps); remove it, or set game.instances",
                    name,
                )
        if not isinstance(self.env_servers, int):
            raise error_at(
                "with `game:` the run starts its env servers (a count): their GameLink follows "
                "this run's learner, which external env servers cannot",
                "env_servers",
            )

    @model_validator(mode="after")
    def _batch(self) -> GameJobSettings:
        if self.game is not None:
            self._check_game()
            return self  # the env id is the game's; the batch depends on its agents
        self._check_env_id()
        servers = self.env_servers if isinstance(self.env_servers, int) else len(self.env_servers)
        total = self.num_actors * self.num_envs
        if total > MAX_TOTAL_ENVS:
            raise ValueError(
                f"num_actors x num_envs = {self.num_actors} x {self.num_envs} = {total} envs, "
                f"more than the {MAX_TOTAL_ENVS} allowed in one run"
            )
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
        """Transitions per update (with ``game:``, per agent of a game process)."""
        return self.default_fragments * self.rollout_length * self.num_envs

    @property
    def versions_ahead(self) -> int:
        """Updates ahead of the learner an actor may collect: one (PPO, A2C)."""
        return 1

    @property
    def default_fragments(self) -> int:
        """Fragments per update: as set, else one per actor (or per game process: GameLink
        publishes one T x agents fragment per link)."""
        if self.fragments_per_update is not None:
            return self.fragments_per_update
        return self.game.instances if self.game is not None else self.num_actors


def _env_server_names(settings: GameJobSettings) -> list[str]:
    if isinstance(settings.env_servers, list):
        return list(settings.env_servers)
    return [f"env-{i}" for i in range(settings.env_servers)]


def _game_entries(
    s: GameJobSettings, servers: list[str], policy: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(env servers hosting GameLink for the learner, the game's process services)."""
    assert s.game is not None
    given = s.env_server.get("game_link", {})
    game_link: Any = {
        "enabled": True,
        "policy": "learner",
        "learner": "learner",
        "rollout_length": s.rollout_length,
        "policy_config": policy,
        "seed": s.seed,
        # Each game's share of an update, as an actor's: its link's replies wait rather than run
        # more than one update ahead of the learner, which would drop what they made as stale
        # (and, on a loaded machine, spend its time reading and dropping them).
        "fragments_per_version": -(-s.default_fragments // s.game.instances),
        **(given if isinstance(given, Mapping) else {}),
    }
    if not isinstance(given, Mapping):
        game_link = given  # the env server's settings model says what is wrong with it
    env_servers = [
        {"name": name, "service": "env_server", "restarts": s.restarts,
         "settings": {**s.env_server, "game_link": game_link}}
        for name in servers
    ]  # fmt: skip
    games = []
    for i in range(s.game.instances):
        env = {
            "RLFLEET_GAME_LINK_ADDRESS": f"{{address:{servers[i % len(servers)]}}}",
            "RLFLEET_RUN": "{run}",
            **{k: str(v) for k, v in s.game.env.items()},
        }
        process = {"command": list(s.game.command), "cwd": s.game.cwd, "env": env}
        games.append(
            {"name": f"game-{i}", "service": "process", "restarts": s.restarts,
             "settings": process}
        )  # fmt: skip
    return env_servers, games


def expand(settings: GameJobSettings, run_name: str) -> list[dict[str, Any]]:
    """Env servers first (actors and the learner need them healthy), then the learner (its
    WeightService must be up before actors ask for version 0), then the actors. With ``game:``:
    the env servers, the game's processes (the learner takes its spaces from the game that
    connected), then the learner; no actors."""
    s = settings
    servers = _env_server_names(s)
    policy = {"hidden_sizes": list(s.hidden_sizes), "activation": s.activation}
    entries: list[dict[str, Any]] = []
    if s.game is not None:
        env_servers, games = _game_entries(s, servers, policy)
        entries += env_servers + games
    elif isinstance(s.env_servers, int):
        for name in servers:
            env = {"preload": [s.env_id], **s.env_server}
            entry = {"name": name, "service": "env_server", "restarts": s.restarts}
            entries.append({**entry, "settings": env})
    fragments_per_update = s.default_fragments
    learner = {
        **s.model_dump(include=set(GameTrainingKnobs.model_fields)),
        "env_servers": servers[:1],
        "policy": policy,
        "fragments_per_update": fragments_per_update,
        "ranks": s.learner_ranks,
    }
    entries.append(
        {"name": "learner", "service": "learner", "main": True, "restarts": s.restarts,
         "settings": learner}
    )  # fmt: skip
    if s.game is None:
        entries += _actor_entries(s, servers, policy, fragments_per_update)
    return _place_cpus(entries, s)


def _actor_entries(
    s: GameJobSettings, servers: list[str], policy: dict[str, Any], fragments_per_update: int
) -> list[dict[str, Any]]:
    entries = []
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
            "double_buffer": s.double_buffer,
            "policy": "learner",
            "learner": "learner",
            # Each actor's share of an update: paces the actor to `versions_ahead` updates ahead.
            "fragments_per_version": -(-fragments_per_update // s.num_actors),
            "versions_ahead": s.versions_ahead,
            "policy_config": policy,
            "device": "cpu",
        }
        entries.append(
            {"name": f"actor-{i}", "service": "game_actor", "restarts": s.restarts,
             "settings": actor}
        )  # fmt: skip
    return entries


def _place_cpus(entries: list[dict[str, Any]], s: GameJobSettings) -> list[dict[str, Any]]:
    """``cpu_placement: auto``: the learner on a CPU of its own, the others on the rest
    (services.placement.own_cpu_for). The learner's update is the critical path of a PPO run:
    actors, env servers and games time-sliced onto its core slow every update. Not with
    several learner ranks, which need CPUs of their own."""
    if s.cpu_placement != "auto" or s.learner_ranks != 1:
        return entries
    return own_cpu_for(entries, "learner")


PPO_JOB = JobSpec(kind="ppo", settings=GameJobSettings, expand=expand, watch="episode")


class A2CJobSettings(GameJobSettings):
    """A2C: the same knobs, one epoch over the whole batch by default."""

    algo: str = knob(GameTrainingKnobs, "algo", default="a2c")
    update_epochs: int = knob(GameTrainingKnobs, "update_epochs", default=1)


A2C_JOB = JobSpec(kind="a2c", settings=A2CJobSettings, expand=expand, watch="episode")


class APPOJobSettings(GameJobSettings):
    """Asynchronous PPO (the ``appo`` preset: the clipped surrogate on V-trace advantages, V-trace
    value targets): fragments up to ``max_policy_lag`` versions old are corrected by V-trace
    instead of dropped. Each actor may collect up to ``max_policy_lag`` updates ahead of the
    learner (the PPO job's credit pacing with that bound instead of one)."""

    @property
    def versions_ahead(self) -> int:
        return self.max_policy_lag

    algo: str = knob(GameTrainingKnobs, "algo", default="appo")
    # APPO's own knob: lagged fragments are corrected, not dropped, so the bound means more.
    max_policy_lag: int = Field(
        default=4,
        ge=1,
        description="fragments more policy versions old than this are dropped; V-trace "
        "corrects the others",
    )


APPO_JOB = JobSpec(kind="appo", settings=APPOJobSettings, expand=expand, watch="episode")

"""Settings of the `game_actor` kind (YAML `settings:` or RLFLEET_GAME_ACTOR__<KEY>).

Validated before anything starts (services/config.py), so the combinations that cannot work
(a `learner` policy without a learner, fewer envs than env servers) fail at load time with the
key named, not minutes later inside the actor.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from common.policy_config import PolicyConfig
from services.config import ServiceRef, StrictModel, Switch

__all__ = ["GameActorSettings"]

# An optional ServiceRef, spelled with the marker outside the union. (The load-time check of
# instance names, services.config.service_refs, now finds `ServiceRef | None` as well.)
OptionalServiceRef = Annotated[str | None, *get_args(ServiceRef)[1:]]


class GameActorSettings(StrictModel):
    """One actor: `num_envs` environments split over `env_servers`, stepped in lock step."""

    # Instance names (each: every live replica of that instance, as they join and leave;
    # services/membership.py) or host:port addresses (that server only).
    env_servers: list[ServiceRef] = Field(min_length=1)
    env_id: str = Field(min_length=1)
    env_kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to gymnasium.make
    num_envs: int = Field(default=8, ge=1)  # in total, split evenly over the servers in use
    # Env k of this actor (0 <= k < num_envs) is seeded with seed + actor_index * num_envs + k,
    # so actors of one job (same seed, actor_index 0, 1, ...) never share an env seed.
    seed: int = Field(default=0, ge=0)
    actor_index: int = Field(default=0, ge=0)
    rollout_length: int = Field(default=128, ge=1)  # T, steps per fragment
    policy: Literal["random", "learner"] = "random"
    learner: OptionalServiceRef = None  # the learner's WeightService (needed by policy: learner)
    policy_config: PolicyConfig = PolicyConfig()  # as the learner's `policy`
    # Learner mode: how many of this actor's fragments the learner turns into one version. The
    # actor then collects at most one update ahead of the learner (waiting up to version_wait_s
    # for the version it needs). None = never wait.
    fragments_per_version: int | None = Field(default=None, ge=1)
    # How many updates ahead of the learner the actor may collect: 1 for PPO; APPO lets it run
    # up to its max_policy_lag ahead (V-trace corrects those fragments).
    versions_ahead: int = Field(default=1, ge=1, le=64)
    version_wait_s: float = Field(default=30.0, gt=0)
    total_steps: int = Field(default=0, ge=0)  # env steps of this actor; 0 = until stopped
    # Publish RolloutFragments; unset means "when the policy is the learner's".
    publish_fragments: bool | None = None
    stats_interval_s: float = Field(default=5.0, gt=0)  # Metrics event period
    device: str = "cpu"  # torch device of the policy forward
    request_timeout_s: float = Field(default=30.0, gt=0)  # one env request's deadline
    reconnect_timeout_s: float = Field(default=60.0, gt=0)  # give up on a dead env server after
    # Env servers on this host: "auto" steps them through a shared-memory ring when the server
    # accepts the offer (docs/colocated.md), else over gRPC; "off" always uses gRPC.
    colocated: Annotated[Literal["auto", "off"], Switch] = "auto"
    # Poll a co-located server's answer this long (microseconds) before sleeping until it comes:
    # no wake-up per step, at the cost of a busy core. Pair it with the env server's setting of
    # the same name where cores are spare (docs/colocated.md); 0 (off) by default.
    colocated_busy_poll_us: int = Field(default=0, ge=0, le=10_000)
    # Then wait for it up to this long (microseconds) asleep in the kernel, the event loop
    # blocked, rather than in the event loop, which saves the loop's round per step
    # (docs/colocated.md). Only where it cannot serialize anything: one
    # env server and double_buffer off (else its sessions' steps are awaited together).
    colocated_block_us: int = Field(default=10_000, ge=0, le=1_000_000)
    # Double-buffered sampling (sampler/actors/sampling.py): two sessions per env server, one
    # half of the envs stepping while the policy infers on the other; needs 2+ envs per server.
    # Off by default: it pays only where cores are spare or the policy is heavy, as for Atari's
    # CNN and not CartPole's MLP (bench/results/actor_throughput*.json).
    double_buffer: Annotated[Literal["on", "off"], Switch] = "off"
    weights_timeout_s: float = Field(default=600.0, gt=0)  # wait this long for the first version

    @model_validator(mode="after")
    def _consistent(self) -> GameActorSettings:
        if self.policy == "learner" and not self.learner:
            raise ValueError("policy 'learner' needs `learner` (the learner's instance name)")
        if self.num_envs < len(self.env_servers):
            raise ValueError(
                f"num_envs={self.num_envs} is fewer than the {len(self.env_servers)} env servers: "
                "every server needs at least one env"
            )
        if self.double_buffer == "on" and self.num_envs // 2 < len(self.env_servers):
            raise ValueError(
                f"double_buffer 'on' needs at least 2 envs per env server; num_envs="
                f"{self.num_envs} over {len(self.env_servers)} servers gives some fewer"
            )
        return self

    @property
    def publishes(self) -> bool:
        """Whether this actor publishes fragments (explicit, or because it trains a learner)."""
        if self.publish_fragments is None:
            return self.policy == "learner"
        return self.publish_fragments

    def env_seed(self) -> int:
        """Seed of this actor's env 0 (env k gets env_seed() + k)."""
        return self.seed + self.actor_index * self.num_envs

"""The env server's `game_link` settings (YAML `settings: {game_link: {...}}`)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from common.policy_config import PolicyConfig
from services.config import ServiceRef, StrictModel

__all__ = ["GameLinkSettings"]

# An optional ServiceRef (see sampler/actors/settings.py for why it is spelled this way).
OptionalServiceRef = Annotated[str | None, *get_args(ServiceRef)[1:]]


class GameLinkSettings(StrictModel):
    """GameLinkService on the env server's port; off unless `enabled`."""

    enabled: bool = False
    policy: Literal["learner", "random"] = "random"
    learner: OptionalServiceRef = None  # whose weights the policy follows (policy: learner)
    policy_config: PolicyConfig = PolicyConfig()  # as the learner's `policy`
    device: str = "cpu"  # torch device of the policy forward
    seed: int = Field(default=0, ge=0)  # of the policy's sampling
    rollout_length: int = Field(default=128, ge=1)  # T of the fragments a link publishes
    # Publish fragments and episode statistics; unset means "when the policy is the learner's".
    publish_fragments: bool | None = None
    # Pacing, as the game actors': the learner turns this many of a link's fragments into one
    # version, so the link's replies wait (up to version_wait_s) rather than run more than one
    # update ahead of the learner (whose max_policy_lag would drop what they made). None: never.
    fragments_per_version: int | None = Field(default=None, ge=1)
    version_wait_s: float = Field(default=30.0, gt=0)
    max_links: int = Field(default=64, ge=1)  # live or resumable links at once
    max_agents_per_link: int = Field(default=1024, ge=1)  # Hello.num_agents limit
    max_in_flight: int = Field(default=8, ge=1)  # cap of Welcome.max_in_flight
    resume_window_s: float = Field(default=30.0, ge=0)  # keep a broken link's state this long
    weights_timeout_s: float = Field(default=3600.0, gt=0)  # wait this long for the first version
    stats_interval_s: float = Field(default=5.0, gt=0)  # Metrics event period per link

    @model_validator(mode="after")
    def _consistent(self) -> GameLinkSettings:
        if self.policy == "learner" and not self.learner:
            raise ValueError("game_link policy 'learner' needs `learner` (the learner's name)")
        return self

    @property
    def publishes(self) -> bool:
        if self.publish_fragments is None:
            return self.policy == "learner"
        return self.publish_fragments

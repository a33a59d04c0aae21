"""Settings of the `rollout` kind (YAML `settings:` or RLFLEET_ROLLOUT__<KEY>).

A rollout driver turns prompts from the run's prompt queue into scored TrajectoryGroups: it asks
a SamplerService for `group_size` completions per prompt, scores them with a RewardService and
publishes one group per prompt. Validated before anything starts, so combinations that cannot
work (expert completions without a tokenizer path) fail at load time with the key named.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from common.datasets import DatasetSpecError, iter_tasks
from services.bus.subjects import validate_token
from services.config import ServiceRef, StrictModel
from services.errors import InvalidArgument

__all__ = ["RewardSpec", "RolloutSettings", "SamplingSettings", "TextEnvRollout"]


class RewardSpec(StrictModel):
    """One reward function the RewardService runs on every completion (RewardWeight)."""

    name: str = Field(min_length=1)  # as listed by RewardService.ListRewards, e.g. "accuracy"
    weight: float = 1.0  # multiplier in the total; 0 reports the score without counting it
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the function's keyword arguments
    timeout_s: float | None = Field(default=None, gt=0)  # per request; None: server default


class SamplingSettings(StrictModel):
    """How completions are sampled (SamplingParams; n is `group_size`, logprobs always on)."""

    temperature: float = Field(default=1.0, ge=0)  # 0 is greedy (a group of equal completions)
    top_p: float = Field(default=1.0, gt=0, le=1)  # nucleus mass; 1 = off
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0 = off
    min_p: float = Field(default=0.0, ge=0, le=1)  # 0 = off
    max_tokens: int = Field(default=512, ge=1)  # completion length limit (truncated beyond)
    stop: list[str] = Field(default_factory=list, max_length=16)  # stop strings
    stop_token_ids: list[int] = Field(default_factory=list)  # beside the model's EOS tokens


class TextEnvRollout(StrictModel):
    """Multi-turn rollouts: each prompt task (a seed, from the ``env_seeds`` dataset) is a group
    of ``group_size`` episodes of a text environment on an env server (docs/text_envs.md),
    played turn by turn on one sampler replica (clients/env/episodes.py)."""

    env_id: str = Field(min_length=1)  # a text env id the env server creates, e.g. Calculator-v0
    env_server: ServiceRef  # EnvService instance name (its live replicas) or host:port
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the env's arguments, e.g. split
    max_turns: int = Field(default=8, ge=1)  # model turns per episode
    max_total_tokens: int = Field(default=1024, ge=16)  # prompt and every turn, per episode
    wall_clock_s: float = Field(default=600.0, gt=0)  # for a whole group
    step_timeout_s: float = Field(default=120.0, gt=0)  # one env request's answer, at most


class RolloutSettings(StrictModel):
    """One rollout driver. Several drivers of a run share one prompt queue; exactly one of them
    feeds it (`feed: true`; the job expansion sets it on driver 0)."""

    # SamplerService instance names (each: every live replica of it; services/membership.py) or
    # host:port, one or a list; each call goes to the one with the fewest calls in flight.
    sampler: list[ServiceRef] = Field(min_length=1)
    reward_service: ServiceRef  # RewardService instance name (its live replicas) or host:port
    # Where prompts come from: {"jsonl": PATH} or {"generator": NAME, ...} (common/datasets.py).
    dataset: dict[str, Any]
    # The policy's Hugging Face folder or id, for the tokenizer that turns expert solutions into
    # token ids; needed only with expert_completions.
    model_path: str | None = None
    group_size: int = Field(default=8, ge=1)  # G, completions per prompt (SamplingParams.n)
    prompts_per_call: int = Field(default=8, ge=1)  # prompts in one Generate request
    # Generate calls this driver keeps going at once (each takes its own prompts). 2 overlaps one
    # call's scoring and publishing, and its slowest completions, with the next call.
    concurrency: int = Field(default=2, ge=1)
    sampling: SamplingSettings = SamplingSettings()
    # Single-turn: scored on every completion, empty: the server's default set. With `env`:
    # scored on every episode's transcript and added to the env's reward, empty: none.
    rewards: list[RewardSpec] = Field(default_factory=list)
    # Feed the prompt queue from `dataset` (one driver per run; clients/trajectories/prompts.py).
    feed: bool = False
    queue: str = "prompts"  # prompt work queue name (subject rlfleet.v1.work.<run>.<queue>)
    # Prompts kept in the queue stream at most (waiting plus taken but not yet acked): bounds how
    # far the feeder runs ahead of an infinite generator. Keep it above drivers x concurrency x
    # prompts_per_call, or drivers wait for prompts.
    queue_depth: int = Field(default=256, ge=1)
    # Passes over a finite dataset (JSONL, or a generator with `count`); None: until stopped.
    epochs: int | None = Field(default=None, ge=1)
    # An unacked prompt goes back to the queue this long after its driver stopped heartbeating
    # (a driver that died); live drivers heartbeat every third of it while they work.
    prompt_ack_wait_s: float = Field(default=60.0, ge=3)
    # Pacing (see clients/trajectories/pacing.py). Groups of this driver the learner turns into one
    # weight version; None: never wait for the learner (standalone rollouts, benchmarks).
    groups_per_version: int | None = Field(default=None, ge=1)
    # Oldest version a group may be sampled with, counted back from the version that trains on
    # it. 0 = strictly on-policy (the driver waits while the learner trains); as the learner's.
    max_policy_lag: int = Field(default=1, ge=0)
    # Pacing waits this long for a version before it restarts its count from the version at
    # hand (the learner restarted, or drivers joined or left).
    version_wait_s: float = Field(default=300.0, gt=0)
    # Append one expert completion (the task's `solution`, tokenized) to each group whose task
    # has one: CHORD and other off-policy guidance. Needs model_path.
    expert_completions: bool = False
    # Sampling seed: each call's seed derives from it and the call's first prompt, so a rerun
    # samples the same at the same weights. None: random.
    seed: int | None = Field(default=None, ge=0)
    generate_timeout_s: float = Field(default=600.0, gt=0)  # deadline of one Generate call
    score_timeout_s: float = Field(default=120.0, gt=0)  # deadline of one Score call
    # How long the driver waits at start for the sampler and reward service to report healthy
    # (vLLM may take minutes to load a model).
    startup_timeout_s: float = Field(default=1800.0, gt=0)
    metrics_interval_s: float = Field(default=10.0, gt=0)  # Metrics event period
    # Multi-turn rollouts on a text env instead of single-turn completions. Needs model_path
    # (the chat template renders the env's turns).
    env: TextEnvRollout | None = None

    @field_validator("sampler", mode="before")
    @classmethod
    def _one_sampler(cls, value: Any) -> Any:
        # A list type (not `ServiceRef | list`) keeps the ServiceRef marker where the load-time
        # check of instance names looks for it.
        return [value] if isinstance(value, str) else value

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Building the iterator checks the spec's keys and a generator's arguments without
        # reading a task (iteration is lazy; a missing JSONL file is reported when feeding).
        try:
            iter_tasks(value)
        except DatasetSpecError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        try:
            return validate_token(value, "queue", underscore=False)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

    @model_validator(mode="after")
    def _consistent(self) -> RolloutSettings:
        if self.expert_completions and not self.model_path:
            raise ValueError("expert_completions needs model_path (the tokenizer's folder or id)")
        if self.env is not None and not self.model_path:
            raise ValueError("env (multi-turn rollouts) needs model_path (the tokenizer's folder)")
        if self.env is not None and self.expert_completions:
            raise ValueError("env: expert completions are for single-turn prompts")
        names = [reward.name for reward in self.rewards]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"rewards: {', '.join(twice)} named more than once")
        return self

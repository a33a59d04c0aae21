"""Trajectory groups off the bus -> padded token batches for the LM update.

A ``TrajectoryGroup`` holds one prompt and its G completions (plus, for CHORD, expert ones).
Decoding checks every tensor's dtype and shape and raises ``InvalidArgument`` naming the field,
so one malformed message is dropped and counted instead of stopping the learner.

Layout of a collated batch (right padding, B sequences of prompt + completion, L tokens): position
t of the ``[B, L-1]`` tensors scores token t+1, so completion token j of a sequence whose prompt
has P tokens sits at position P - 1 + j.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.tensor import decode as decode_tensor
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument

__all__ = ["Batch", "Sample", "collate", "decode_group"]


@dataclass(frozen=True)
class Sample:
    """One completion of a group, ready to train on."""

    group_id: str
    prompt_ids: np.ndarray  # int64 [P]
    completion_ids: np.ndarray  # int64 [C]
    rollout_logp: np.ndarray | None  # float32 [C]; None for expert completions
    loss_mask: np.ndarray  # bool [C]
    reward: float | None  # None: no reward function scored it (not trained on)
    truncated: bool  # stopped by the length limit
    expert: bool
    policy_version: int
    scores: dict[str, float]  # raw per-function scores that were OK


def _ids(tensor: tensor_pb2.Tensor, field: str, *, allow_empty: bool = False) -> np.ndarray:
    array = decode_tensor(tensor, name=field)
    if array.dtype not in (np.int32, np.int64) or array.ndim != 1:
        raise InvalidArgument(
            f"{field}: expected int32 [L], got {array.dtype} {list(array.shape)}", field=field
        )
    if not allow_empty and array.size == 0:
        raise InvalidArgument(f"{field}: empty", field=field)
    if array.size and array.min() < 0:
        raise InvalidArgument(f"{field}: negative token id", field=field)
    return array.astype(np.int64)


def decode_group(msg: trajectory_pb2.TrajectoryGroup, vocab_size: int) -> list[Sample]:
    """The samples of one TrajectoryGroup; InvalidArgument names the first bad field."""
    prompt = _ids(msg.prompt_token_ids, "prompt_token_ids")
    samples = []
    for i, comp in enumerate(msg.completions):
        where = f"completions[{i}]"
        ids = _ids(comp.token_ids, f"{where}.token_ids", allow_empty=True)
        if ids.size and ids.max() >= vocab_size:
            raise InvalidArgument(
                f"{where}.token_ids: id {int(ids.max())} is outside the vocabulary ({vocab_size})",
                field=f"{where}.token_ids",
            )
        logp = None
        if not comp.expert:
            logp = decode_tensor(comp.logprobs, name=f"{where}.logprobs").astype(np.float32)
            if logp.shape != ids.shape:
                raise InvalidArgument(
                    f"{where}.logprobs: shape {list(logp.shape)} does not match token_ids "
                    f"{list(ids.shape)}",
                    field=f"{where}.logprobs",
                )
            if not np.isfinite(logp).all():
                raise InvalidArgument(f"{where}.logprobs: not finite", field=f"{where}.logprobs")
        mask = np.ones(ids.shape, dtype=bool)
        if comp.HasField("loss_mask"):
            mask = decode_tensor(comp.loss_mask, name=f"{where}.loss_mask").astype(bool)
            if mask.shape != ids.shape:
                raise InvalidArgument(
                    f"{where}.loss_mask: shape does not match token_ids",
                    field=f"{where}.loss_mask",
                )
        reward = comp.reward if comp.HasField("reward") else None
        if reward is not None and not math.isfinite(reward):
            raise InvalidArgument(f"{where}.reward: not finite", field=f"{where}.reward")
        samples.append(
            Sample(
                group_id=msg.group_id,
                prompt_ids=prompt,
                completion_ids=ids,
                rollout_logp=logp,
                loss_mask=mask,
                reward=reward,
                truncated=comp.finish_reason == sampler_pb2.FINISH_REASON_LENGTH,
                expert=comp.expert,
                policy_version=comp.policy_version or msg.policy_version,
                scores={
                    s.name: s.score for s in comp.rewards if s.status == reward_pb2.SCORE_STATUS_OK
                },
            )
        )
    return samples


@dataclass
class Batch:
    """Padded tensors of B sequences (see the module docstring for the layout)."""

    input_ids: Tensor  # [B, L] int64
    attention_mask: Tensor  # [B, L] int64
    mask: Tensor  # [B, L-1] bool: completion tokens that count in the loss
    rollout_logp: Tensor  # [B, L-1] float32 (0 outside the mask and for expert rows)
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] int64
    truncated: Tensor  # [B] bool
    expert: Tensor  # [B] bool

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Tensor) -> Batch:
        return Batch(**{k: v[rows] for k, v in vars(self).items()})


def collate(samples: Sequence[Sample], pad_id: int) -> Batch:
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    b, length = len(samples), max(lengths)
    input_ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attention = torch.zeros((b, length), dtype=torch.int64)
    mask = torch.zeros((b, length - 1), dtype=torch.bool)
    rollout = torch.zeros((b, length - 1), dtype=torch.float32)
    groups: dict[str, int] = {}
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, :p] = torch.from_numpy(s.prompt_ids)
        input_ids[row, p : p + c] = torch.from_numpy(s.completion_ids)
        attention[row, : p + c] = 1
        mask[row, p - 1 : p - 1 + c] = torch.from_numpy(s.loss_mask)
        if s.rollout_logp is not None:
            rollout[row, p - 1 : p - 1 + c] = torch.from_numpy(s.rollout_logp)
        groups.setdefault(s.group_id, len(groups))
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        rollout_logp=rollout,
        rewards=torch.tensor([s.reward or 0.0 for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([groups[s.group_id] for s in samples], dtype=torch.int64),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        expert=torch.tensor([s.expert for s in samples], dtype=torch.bool),
    )

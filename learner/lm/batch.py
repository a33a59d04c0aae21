"""Trajectory groups off the bus -> padded token batches for the LM update.

A ``TrajectoryGroup`` holds one prompt and its G completions (plus, for CHORD, expert ones).
Decoding checks every tensor's dtype and shape and raises ``InvalidArgument`` naming the field,
so one malformed message is dropped and counted instead of stopping the learner.

Layout of a collated batch (right padding, B sequences of prompt + completion, L tokens): position
t of the ``[B, L-1]`` tensors scores token t+1, so completion token j of a sequence whose prompt
has P tokens sits at position P - 1 + j.

A vision-language model's prompt holds its images already expanded to placeholder tokens; their
pixels ride beside the tokens, ``[B, I, ...]`` with all-zero padding images after a row's own
(the model skips an image that is all zeros).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.tensor import decode as decode_tensor
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument

__all__ = [
    "Batch",
    "PromptPixels",
    "Sample",
    "collate",
    "decode_group",
    "image_counts",
    "image_inputs",
    "pad_images",
]


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
    # The prompt's images as the model's image processor made them (None: a text prompt).
    pixel_values: np.ndarray | None = None  # float32 [I, 3, H, W]
    pixel_attention_mask: np.ndarray | None = None  # bool [I, H, W]


@dataclass(frozen=True)
class PromptPixels:
    """A group's images (none for a text prompt), processed for a vision-language model, and
    what its tokens must hold for them."""

    values: np.ndarray  # float32 [I, 3, H, W]: one per image slot (I may be 0)
    mask: np.ndarray  # bool [I, H, W]
    image_token_id: int  # the placeholder each slot is expanded to
    tokens_per_image: int  # placeholders per slot


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


def _check_images(
    msg: trajectory_pb2.TrajectoryGroup, prompt: np.ndarray, pixels: PromptPixels | None
) -> None:
    """InvalidArgument unless ``pixels`` (None: the model reads text only) fit the images the
    group names and the placeholders its prompt holds: the model fills every placeholder of a
    batch, in order, with the batch's image features, and fails when the counts differ."""
    count = len(msg.image_sha256)
    if count and pixels is None:
        raise InvalidArgument(
            f"image_sha256: the group names {count} images, but the learner's model reads text "
            "only",
            field="image_sha256",
        )
    if pixels is None:
        return
    held = int((prompt == pixels.image_token_id).sum())
    expected = len(pixels.values) * pixels.tokens_per_image
    if held != expected:
        raise InvalidArgument(
            f"image_sha256: {count} images make {expected} image tokens, but prompt_token_ids "
            f"holds {held}",
            field="image_sha256",
        )


def decode_group(
    msg: trajectory_pb2.TrajectoryGroup, vocab_size: int, pixels: PromptPixels | None = None
) -> list[Sample]:
    """The samples of one TrajectoryGroup; InvalidArgument names the first bad field.
    ``pixels``: on a vision-language model, the images the group names (``image_sha256``; none
    for a text prompt), processed for the model."""
    prompt = _ids(msg.prompt_token_ids, "prompt_token_ids")
    _check_images(msg, prompt, pixels)
    samples = []
    for i, comp in enumerate(msg.completions):
        where = f"completions[{i}]"
        ids = _ids(comp.token_ids, f"{where}.token_ids", allow_empty=True)
        if ids.size and ids.max() >= vocab_size:
            raise InvalidArgument(
                f"{where}.token_ids: id {int(ids.max())} is outside the vocabulary ({vocab_size})",
                field=f"{where}.token_ids",
            )
        if pixels is not None and bool((ids == pixels.image_token_id).any()):
            # The sampler embedded a generated placeholder as text; the training forward would
            # fill it with image features it does not have (samplers should never sample it).
            raise InvalidArgument(
                f"{where}.token_ids: holds the image token ({pixels.image_token_id}), which no "
                "image fills",
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
                pixel_values=None if pixels is None or not len(pixels.values) else pixels.values,
                pixel_attention_mask=None
                if pixels is None or not len(pixels.mask)
                else pixels.mask,
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
    # The rows' images, zero-padded to the most any row has (None: no row has one).
    pixel_values: Tensor | None = None  # [B, I, 3, H, W] float32
    pixel_attention_mask: Tensor | None = None  # [B, I, H, W] bool

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Tensor) -> Batch:
        picked: dict[str, Any] = {k: None if v is None else v[rows] for k, v in vars(self).items()}
        values, mask = _trim_images(picked["pixel_values"], picked["pixel_attention_mask"])
        return Batch(**{**picked, "pixel_values": values, "pixel_attention_mask": mask})


def image_counts(pixel_values: Tensor) -> Tensor:
    """``[B]`` images of each row of ``pixel_values`` ``[B, I, 3, H, W]``: the ones not all
    zero (padding images are all zero and come after a row's own)."""
    return pixel_values.flatten(2).ne(0).any(-1).sum(-1)


def _trim_images(values: Tensor | None, mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Image slots cut to the most a row has (None when no row has any): selected rows need not
    carry the padding of others, nor a forward an image pass with no image."""
    if values is None:
        return None, None
    most = int(image_counts(values).max()) if len(values) else 0
    if most == 0:
        return None, None
    return values[:, :most], None if mask is None else mask[:, :most]


def _pad_images(samples: Sequence[Sample]) -> tuple[Tensor | None, Tensor | None]:
    """The samples' images stacked ``[B, I, ...]``, zero-padded (None when none has one)."""
    return pad_images(
        [
            (s.pixel_values, s.pixel_attention_mask)
            if s.pixel_values is not None and s.pixel_attention_mask is not None
            else None
            for s in samples
        ]
    )


def pad_images(
    pixels: Sequence[tuple[np.ndarray, np.ndarray] | None],
) -> tuple[Tensor | None, Tensor | None]:
    """Rows' images (pixel_values [I, 3, H, W] and pixel_attention_mask [I, H, W]; None: no
    image) stacked ``[B, I, ...]`` and zero-padded: a model drops all-zero images. (None, None)
    when no row has one."""
    shown = [p for p in pixels if p is not None and len(p[0])]
    if not shown:
        return None, None
    most = max(len(values) for values, _ in shown)
    first_values, first_mask = shown[0]
    values = torch.zeros((len(pixels), most, *first_values.shape[1:]), dtype=torch.float32)
    mask = torch.zeros((len(pixels), most, *first_mask.shape[1:]), dtype=torch.bool)
    for row, p in enumerate(pixels):
        if p is None:
            continue
        n = len(p[0])
        values[row, :n] = torch.from_numpy(p[0])
        mask[row, :n] = torch.from_numpy(p[1])
    return values, mask


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
    pixel_values, pixel_mask = _pad_images(samples)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        rollout_logp=rollout,
        rewards=torch.tensor([s.reward or 0.0 for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([groups[s.group_id] for s in samples], dtype=torch.int64),
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        expert=torch.tensor([s.expert for s in samples], dtype=torch.bool),
        pixel_values=pixel_values,
        pixel_attention_mask=pixel_mask,
    )


def image_inputs(
    pixel_values: Tensor | None, pixel_attention_mask: Tensor | None, device: torch.device
) -> dict[str, Tensor]:
    """The forward's image keywords on ``device`` (none for a text batch: a text model's
    forward takes no such arguments)."""
    if pixel_values is None:
        return {}
    images = {"pixel_values": pixel_values.to(device)}
    if pixel_attention_mask is not None:
        images["pixel_attention_mask"] = pixel_attention_mask.to(device)
    return images

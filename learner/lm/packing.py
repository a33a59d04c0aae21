"""Sequence packing: a batch's right-padded sequences laid end to end in fewer rows of at most
``budget`` tokens, each sequence with its own positions (restarting at 0) and attention confined
to itself (a block-diagonal causal mask), so one packed forward computes what the unpacked one
does, on less padding.

``packed_logprobs`` is ``model.sequence_logprobs`` through a packed forward: the same
``[B, L-1]`` layout back (position t of row b scores token t+1 of sequence b), so the losses
read it unchanged. Positions past a sequence's last token are 0 there (the unpacked forward
leaves the padding's values, which no loss reads: they are outside every mask).

Images (a vision-language model): a packed row's images are its sequences' images in the order
the sequences sit in it, so the model fills the row's image placeholders, in order, with the
right features (``packed_images``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.lm.batch import image_counts, image_inputs

__all__ = ["Packed", "pack", "packed_images", "packed_logprobs"]


@dataclass(frozen=True)
class Packed:
    """B sequences in R packed rows of S tokens."""

    input_ids: Tensor  # [R, S] int64 (padding: the sequences' own pad, never attended)
    position_ids: Tensor  # [R, S] int64, from 0 in every sequence
    attention_mask: Tensor  # [R, 1, S, S] bool: query i may attend key j
    row: Tensor  # [B] int64: the packed row of sequence b
    start: Tensor  # [B] int64: the column of its first token
    length: Tensor  # [B] int64: its tokens


def pack(input_ids: Tensor, attention_mask: Tensor, budget: int) -> Packed:
    """First-fit decreasing: the longest sequence first, each into the first row with room (a
    sequence longer than ``budget`` gets a row of its own). input_ids, attention_mask [B, L]."""
    lengths = attention_mask.sum(-1).tolist()  # right padding: sequence b is its first n tokens
    rows: list[list[int]] = []
    used: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[b])
        for r, filled in enumerate(used):
            if filled + n <= budget:
                rows[r].append(b)
                used[r] += n
                break
        else:
            rows.append([b])
            used.append(n)
    width = max(used)
    count = len(rows)
    packed_ids = torch.zeros((count, width), dtype=input_ids.dtype)
    positions = torch.zeros((count, width), dtype=torch.int64)
    # Segment of each column: its sequence's index in the row; padding a distinct negative id
    # per column, so it attends only to itself (a query attending to nothing would give NaN).
    segment = -1 - torch.arange(width).repeat(count, 1)
    row_of = torch.zeros(len(lengths), dtype=torch.int64)
    start_of = torch.zeros(len(lengths), dtype=torch.int64)
    for r, members in enumerate(rows):
        at = 0
        for k, b in enumerate(members):
            n = int(lengths[b])
            packed_ids[r, at : at + n] = input_ids[b, :n]
            positions[r, at : at + n] = torch.arange(n)
            segment[r, at : at + n] = k
            row_of[b], start_of[b] = r, at
            at += n
    causal = torch.tril(torch.ones((width, width), dtype=torch.bool))
    mask = (segment[:, :, None] == segment[:, None, :]) & causal  # [R, S, S]
    return Packed(
        input_ids=packed_ids,
        position_ids=positions,
        attention_mask=mask[:, None],
        row=row_of,
        start=start_of,
        length=torch.tensor(lengths, dtype=torch.int64),
    )


def packed_images(
    p: Packed, pixel_values: Tensor, pixel_attention_mask: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """The images of each packed row: its sequences' own (``pixel_values`` ``[B, I, 3, H, W]``,
    ``pixel_attention_mask`` ``[B, I, H, W]``, all-zero padding images last) one after the
    other in the order the sequences sit in the row, zero-padded -> ``[R, I', ...]`` (None when
    no sequence has an image)."""
    counts = image_counts(pixel_values).tolist()  # [B]
    members: list[list[int]] = [[] for _ in range(p.input_ids.shape[0])]
    for b in sorted(range(len(counts)), key=lambda i: (int(p.row[i]), int(p.start[i]))):
        members[int(p.row[b])].append(b)
    most = max(sum(counts[b] for b in row) for row in members)
    if most == 0:
        return None, None
    values = pixel_values.new_zeros((len(members), most, *pixel_values.shape[2:]))
    mask = None
    if pixel_attention_mask is not None:
        mask = pixel_attention_mask.new_zeros((len(members), most, *pixel_attention_mask.shape[2:]))
    for r, row in enumerate(members):
        at = 0
        for b in row:
            n = counts[b]
            values[r, at : at + n] = pixel_values[b, :n]
            if mask is not None and pixel_attention_mask is not None:
                mask[r, at : at + n] = pixel_attention_mask[b, :n]
            at += n
    return values, mask


def packed_logprobs(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    budget: int,
    *,
    entropy_grad: bool = False,
    entropy: bool = True,
    pixel_values: Tensor | None = None,
    pixel_attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``sequence_logprobs`` of the right-padded ``[B, L]`` batch through one packed forward of
    rows of at most ``budget`` tokens -> (logp [B, L-1], entropy [B, L-1] or None); with the
    rows' images (``pixel_values`` ``[B, I, 3, H, W]``, ``pixel_attention_mask``) packed along."""
    p = pack(input_ids, attention_mask, budget)
    device = input_ids.device
    images: dict[str, Tensor] = {}
    if pixel_values is not None:
        values, mask = packed_images(p, pixel_values, pixel_attention_mask)
        images = image_inputs(values, mask, device)
    logits = model(
        input_ids=p.input_ids.to(device),
        position_ids=p.position_ids.to(device),
        attention_mask=p.attention_mask.to(device),
        **images,
    ).logits  # [R, S, V]
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [R, S-1, V]
    next_ids = p.input_ids[:, 1:].to(device)
    logp_packed = log_probs.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)  # [R, S-1]
    b, length = input_ids.shape
    steps = torch.arange(length - 1)
    valid = (steps[None, :] < (p.length[:, None] - 1)).to(device)  # [B, L-1]
    # Column of position j of sequence b in its packed row (clamped where not valid).
    columns = (p.start[:, None] + steps[None, :]).clamp(max=p.input_ids.shape[1] - 2).to(device)
    rows = p.row[:, None].expand(b, length - 1).to(device)
    zero = torch.zeros((), device=device)
    logp = torch.where(valid, logp_packed[rows, columns], zero)  # [B, L-1]
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        lp = log_probs if entropy_grad else log_probs.detach()
        ent_packed = -(lp.exp() * lp).sum(-1)  # [R, S-1]
        ent = torch.where(valid, ent_packed[rows, columns], zero)  # [B, L-1]
    return logp, ent

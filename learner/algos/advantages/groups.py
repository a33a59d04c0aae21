"""Per-group statistics for group-relative advantage estimators (GRPO, RLOO, REINFORCE++).

A batch holds B completions; ``group_ids[b]`` names the prompt completion b answers (any int64
values, not necessarily contiguous). Helpers return per-completion values, gathered back to ``[B]``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_inputs(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> None:
    """Raise ``ValueError`` unless rewards ``[B]``, group_ids ``[B]`` and mask ``[B, T]`` agree."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must match rewards {tuple(rewards.shape)}, got {tuple(group_ids.shape)}"
        )
    if mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={rewards.shape[0]}, got {tuple(mask.shape)}")


def float_dtype(x: Tensor) -> torch.dtype:
    """The float dtype results are computed in: ``x``'s, promoted to at least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(size, mean, std)`` of each completion's group, each ``[B]``.

    ``std`` is the unbiased sample std (Bessel's correction, n - 1), as ``torch.std`` and verl's
    GRPO; it is 0 for groups of one. A group whose rewards are all equal gets exactly its reward as
    ``mean`` and exactly 0 as ``std``, so ``r - mean`` is exactly 0 there (also for rewards such
    as 0.1 that floats cannot hold: a plain sum would round the mean an ulp away).
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B] group index 0..G-1
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(float_dtype(rewards))  # [B]
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )  # [G]
    # Shifted data: average the offsets from the group's minimum, which are exactly 0 in a
    # group of equal rewards, then add the minimum back.
    low = torch.full_like(count, torch.inf).scatter_reduce_(0, inverse, r, "amin")  # [G]
    offset = r - low[inverse]  # [B] >= 0
    offset_mean = torch.zeros_like(count).index_add_(0, inverse, offset) / count  # [G]
    dev = offset - offset_mean[inverse]  # [B] r - mean
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, dev**2)  # [G]
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G]
    mean = low + offset_mean  # [G]
    return count[inverse], mean[inverse], std[inverse]  # each [B]


def centred(r: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean [], r - mean [B])`` of ``r`` ``[B]``, from the offsets to the minimum as in
    ``group_stats``: when every entry is equal the mean is exactly that value and ``r - mean``
    exactly 0."""
    low = r.min() if r.numel() else r.new_zeros(())
    offset = r - low  # [B]
    offset_mean = offset.mean() if r.numel() else r.new_zeros(())
    return low + offset_mean, offset - offset_mean


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` per-completion values -> ``[B, T]``, zero where ``mask`` is false."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(mask.bool(), values[:, None], zero)  # [B, T]


def reward_metrics(r: Tensor) -> dict[str, Tensor]:
    """``reward_mean`` and ``reward_std`` (unbiased; 0 for one completion, exactly 0 when every
    reward is equal) of ``r`` ``[B]``."""
    mean, dev = centred(r)  # [], [B]
    std = (dev**2).sum() / max(r.numel() - 1, 1)
    return {"reward_mean": mean, "reward_std": std.sqrt()}

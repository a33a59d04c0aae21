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
    GRPO; it is 0 for groups of one.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B] group index 0..G-1
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(float_dtype(rewards))  # [B]
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )  # [G]
    total = torch.zeros_like(count).index_add_(0, inverse, r)  # [G]
    mean = total / count  # [G] (every group has >= 1 member)
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (r - mean[inverse]) ** 2)  # [G]
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G]
    return count[inverse], mean[inverse], std[inverse]  # each [B]


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` per-completion values -> ``[B, T]``, zero where ``mask`` is false."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(mask.bool(), values[:, None], zero)  # [B, T]


def reward_metrics(r: Tensor) -> dict[str, Tensor]:
    """``reward_mean`` and ``reward_std`` (unbiased; 0 for one completion) of ``r`` ``[B]``."""
    return {"reward_mean": r.mean(), "reward_std": r.std() if r.numel() > 1 else r.new_zeros(())}

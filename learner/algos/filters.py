"""DAPO batch filters: dynamic sampling and overlong filtering.

Yu et al. (2025), "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476: §3.2 "Dynamic Sampling" (eq. 11's constraint ``0 < |{correct}| < G``: drop
groups whose completions all score the same, since their GRPO advantages are all 0) and §3.4
"Overlong Reward Shaping" (overlong filtering: mask the loss of truncated completions). The soft
overlong punishment of §3.4 is a reward and lives in the reward service.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def dynamic_sampling_keep(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int64
) -> Tensor:
    """Bool ``[B]``: true for completions whose group's rewards are not all equal.

    Groups of one are dropped (nothing to compare). Exact equality: rewards that differ only by
    rounding noise count as different.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [B]
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # [B]
    group_max = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    group_max = group_max.scatter_reduce(0, inverse, r, reduce="amax")  # [G]
    group_min = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device)
    group_min = group_min.scatter_reduce(0, inverse, r, reduce="amin")  # [G]
    return (group_max > group_min)[inverse]  # [B]


def overlong_mask(
    mask: Tensor,  # [B, T] bool: completion tokens
    truncated: Tensor,  # [B] bool: completion hit the generation length limit
) -> Tensor:
    """``mask`` with every token of truncated completions set to false, ``[B, T]`` bool."""
    if mask.ndim != 2 or truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"mask must be [B, T] and truncated [B], got {tuple(mask.shape)} "
            f"and {tuple(truncated.shape)}"
        )
    return mask.bool() & ~truncated.bool()[:, None]  # [B, T]

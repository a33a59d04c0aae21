"""REINFORCE leave-one-out (RLOO) advantages.

Kool, van Hoof, Welling (2019), "Buy 4 REINFORCE Samples, Get a Baseline for Free!", ICLR
workshop; Ahmadian et al. (2024), "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs", arXiv:2402.14740, eq. (6):
``A_i = r_i - 1/(k-1) sum_{j != i} r_j`` over the k completions of one prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.advantages.groups import (
    broadcast_to_tokens,
    check_inputs,
    float_dtype,
    group_stats,
    reward_metrics,
)
from learner.algos.registry import GROUP_ADVANTAGES


@GROUP_ADVANTAGES.register("rloo")
@torch.no_grad()
def rloo(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int64
    mask: Tensor,  # [B, T] bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """``A_{i,t} = r_i - (sum_g(r) - r_i) / (k - 1)`` on every valid token of completion i.

    Equivalently ``k / (k - 1) * (r_i - mean_g(r))``. A group of one gets advantage 0.
    Returns ``(advantages [B, T] zero where mask is false, {"reward_mean", "reward_std"})``.
    """
    check_inputs(rewards, group_ids, mask)
    size, mean, _ = group_stats(rewards, group_ids)  # [B] each
    r = rewards.to(float_dtype(rewards))  # [B]
    # k / (k - 1) * (r_i - mean) rather than r_i minus the others' mean rebuilt from the sum:
    # that one rounds, and a group of equal rewards must get exactly 0.
    adv = size / (size - 1).clamp(min=1) * (r - mean)  # [B]
    adv = torch.where(size > 1, adv, torch.zeros_like(r))  # [B]
    return broadcast_to_tokens(adv, mask), reward_metrics(r)

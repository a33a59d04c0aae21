"""Group-relative advantages (GRPO outcome supervision) and the Dr. GRPO variant.

Shao et al. (2024), "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv:2402.03300, §4.1.2 (outcome supervision): ``A_i = (r_i - mean(r)) / std(r)`` over
the G completions of one prompt, the same for every token of completion i.
Liu et al. (2025), "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
arXiv:2503.20783, §3.2: drop the division by std (``norm_std=False``).
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


@GROUP_ADVANTAGES.register("grpo")
@torch.no_grad()
def grpo(
    rewards: Tensor,  # [B] float: one scalar reward per completion
    group_ids: Tensor,  # [B] int64: completions with the same id answer the same prompt
    mask: Tensor,  # [B, T] bool: completion tokens that are trained on
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``A_{i,t} = (r_i - mean_g(r)) / (std_g(r) + eps)`` on every valid token of completion i.

    ``std_g`` is the unbiased (n - 1) std of the group's rewards, as ``torch.std`` in verl's
    ``compute_grpo_outcome_advantage``; ``norm_std=False`` gives Dr. GRPO's ``r_i - mean_g(r)``.
    A group of one completion gets advantage 0 (it has no baseline); verl instead keeps ``r_i``.

    Returns ``(advantages [B, T] zero where mask is false, metrics)`` with detached metrics
    ``reward_mean``, ``reward_std`` (over the batch) and ``zero_std_frac`` (fraction of groups whose
    rewards are all equal, so every member's advantage is exactly 0: the groups DAPO's dynamic
    sampling drops, TRL's ``frac_reward_zero_std``).
    """
    check_inputs(rewards, group_ids, mask)
    size, mean, std = group_stats(rewards, group_ids)  # [B] each
    r = rewards.to(float_dtype(rewards))  # [B]
    adv = r - mean  # [B]
    if norm_std:
        adv = adv / (std + eps)  # [B]
    adv = torch.where(size > 1, adv, torch.zeros_like(adv))  # [B]
    n_groups = torch.unique(group_ids).numel()
    # counted by id, not as a sum of 1/size per member, which rounds (7 * 1/7 != 1)
    n_zero_std = torch.unique(group_ids[std == 0]).numel()
    metrics = {
        **reward_metrics(r),
        "zero_std_frac": r.new_tensor(n_zero_std / max(n_groups, 1)),
    }
    return broadcast_to_tokens(adv, mask), metrics

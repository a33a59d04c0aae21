"""REINFORCE++ advantages: token-level discounted returns with global (batch) whitening.

Hu (2025), "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward
Models", arXiv:2501.03262, §3 (token-level KL penalty in the reward, returns
``G_t = sum_{k>=t} gamma^{k-t} r_k``, advantages normalised over the whole global batch) and the
"REINFORCE++-baseline" variant (subtract the group mean of the outcome reward first), as in
OpenRLHF's ``reinforce`` / ``reinforce_baseline`` advantage estimators.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.advantages.groups import check_inputs, float_dtype, group_stats, reward_metrics
from learner.algos.aggregation import masked_mean
from learner.algos.normalize import normalize_advantages
from learner.algos.registry import GROUP_ADVANTAGES


def token_returns(
    rewards: Tensor,  # [B] float: outcome reward, placed on the last valid token
    mask: Tensor,  # [B, T] bool
    token_rewards: Tensor | None = None,  # [B, T] float per-token reward (e.g. -beta * KL)
    gamma: float = 1.0,
) -> Tensor:
    """``G_{b,t} = sum_{k>=t} gamma^{k-t} R_{b,k}`` with ``R = token_rewards`` (zero where masked)
    plus ``rewards[b]`` on the last valid token of row b. Returns ``[B, T]`` (not masked).

    Masked positions inside a row (e.g. tool output between turns) still count as steps for the
    discount, as in OpenRLHF's ``get_cumulative_returns``.
    """
    mask = mask.bool()
    dtype = float_dtype(rewards)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    if token_rewards is None:
        step_r = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)  # [B, T]
    else:
        if token_rewards.shape != mask.shape:
            raise ValueError(
                f"token_rewards must match mask {tuple(mask.shape)}, "
                f"got {tuple(token_rewards.shape)}"
            )
        step_r = torch.where(mask, token_rewards.to(dtype), zero)  # [B, T]
    positions = torch.arange(mask.shape[1], device=mask.device)  # [T]
    last = torch.where(mask, positions, -1).amax(dim=1)  # [B] last valid index, -1 if none
    is_last = (positions[None, :] == last[:, None]) & mask  # [B, T]
    step_r = step_r + torch.where(is_last, rewards.to(dtype)[:, None], zero)  # [B, T]
    if gamma == 1.0:
        return step_r.flip(1).cumsum(1).flip(1)  # [B, T] suffix sums
    out = torch.empty_like(step_r)  # [B, T]
    running = torch.zeros_like(step_r[:, 0])  # [B] G_{t+1}
    for t in range(step_r.shape[1] - 1, -1, -1):
        running = step_r[:, t] + gamma * running
        out[:, t] = running
    return out


def _whitened(
    rewards: Tensor, mask: Tensor, token_rewards: Tensor | None, gamma: float, eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    returns = token_returns(rewards, mask, token_rewards, gamma)  # [B, T]
    adv = normalize_advantages(returns, mask, eps=eps)  # [B, T] zero where mask is false
    valid = mask.bool()
    mean = masked_mean(returns, valid)
    metrics = {
        "return_mean": mean,
        "return_std": masked_mean((returns - mean) ** 2, valid).sqrt(),
    }
    return adv, metrics


@GROUP_ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int64 (unused: REINFORCE++ has no group baseline)
    mask: Tensor,  # [B, T] bool
    *,
    token_rewards: Tensor | None = None,  # [B, T] e.g. -kl_beta * kl_penalty(..., "k1")
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``A = (G - mean(G)) / (std(G) + eps)``, mean and std over every valid token of the batch.

    ``G`` is ``token_returns``: the outcome reward sits on the last valid token, ``token_rewards``
    (the paper's ``-beta * KL(t)``) is added per token, and ``gamma`` discounts (default 1). The
    std uses Bessel's correction (``normalize_advantages``); OpenRLHF divides by the biased one,
    a factor sqrt(N / (N - 1)) apart for N valid tokens.

    Returns ``(advantages [B, T] zero where mask is false, metrics)``: ``reward_mean``,
    ``reward_std``, and ``return_mean``/``return_std`` over valid tokens before whitening.
    """
    check_inputs(rewards, group_ids, mask)
    adv, metrics = _whitened(rewards, mask, token_rewards, gamma, eps)
    return adv, {**reward_metrics(rewards.to(adv.dtype)), **metrics}


@GROUP_ADVANTAGES.register("reinforce_pp_baseline")
@torch.no_grad()
def reinforce_pp_baseline(
    rewards: Tensor,  # [B] float
    group_ids: Tensor,  # [B] int64
    mask: Tensor,  # [B, T] bool
    *,
    token_rewards: Tensor | None = None,  # [B, T]
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE++-baseline: ``r_i - mean_g(r)`` (group mean, groups of one included, which gives
    0), then exactly ``reinforce_pp`` (token returns, global whitening), as OpenRLHF's
    ``reinforce_baseline``. Same returns and metrics as ``reinforce_pp``."""
    check_inputs(rewards, group_ids, mask)
    _, mean, _ = group_stats(rewards, group_ids)  # [B]
    centred = rewards.to(mean.dtype) - mean  # [B]
    adv, metrics = _whitened(centred, mask, token_rewards, gamma, eps)
    return adv, {**reward_metrics(rewards.to(adv.dtype)), **metrics}

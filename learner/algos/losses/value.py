"""Critic (value function) loss: 0.5 * squared error, optionally clipped as in PPO2/CleanRL."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean


def value_loss(
    values: Tensor,  # [B] or [B, T] V_theta(s) under the current critic
    old_values: Tensor | None,  # same shape: V(s) at rollout time (needed only when clipping)
    returns: Tensor,  # same shape: value targets (e.g. GAE lambda-returns)
    clip: float | None = None,
    mask: Tensor | None = None,  # same shape, bool (metrics only)
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample ``0.5 * (V - R)^2``; with ``clip`` the pessimistic PPO2 form

        V_clip = old_V + clip(V - old_V, -clip, +clip)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)

    (Dhariwal et al. 2017, OpenAI Baselines ppo2; CleanRL ``clip_vloss``). Returns the unreduced
    loss and detached metrics: ``value_mean`` and, when clipping, ``vf_clipfrac`` (fraction of
    entries where the clipped term is the larger one).
    """
    unclipped = (values - returns) ** 2  # [B, T]
    with torch.no_grad():
        metrics = {"value_mean": masked_mean(values, mask)}
    if clip is None:
        return 0.5 * unclipped, metrics
    if old_values is None:
        raise ValueError("value_loss(clip=...) needs old_values")
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # [B, T]
    clipped = (v_clipped - returns) ** 2  # [B, T]
    with torch.no_grad():
        metrics["vf_clipfrac"] = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return 0.5 * torch.maximum(unclipped, clipped), metrics

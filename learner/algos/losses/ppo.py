"""PPO clipped surrogate objective.

Schulman, Wolski, Dhariwal, Radford, Klimov (2017), "Proximal Policy Optimization Algorithms",
arXiv:1707.06347, eq. (7). Asymmetric clipping (``clip_high``) as in DAPO (Yu et al. 2025,
arXiv:2503.14476, "clip-higher"); dual clip (``clip_ratio_c``) as in Ye et al. (2020), "Mastering
Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729, eq. (5), and
verl's ``clip_ratio_c``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean
from learner.algos.registry import POLICY_LOSSES


@POLICY_LOSSES.register("ppo")
def ppo_clip(
    logp: Tensor,  # [B] or [B, T] log pi_theta(a|s) under the current policy
    old_logp: Tensor,  # same shape: log pi_old(a|s) of the behaviour policy
    adv: Tensor,  # same shape (or broadcastable): advantages
    mask: Tensor | None = None,  # same shape, bool: entries that count (metrics only)
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample clipped surrogate loss (to minimise) and detached metrics.

        ratio = exp(logp - old_logp)
        loss  = max(-adv * ratio, -adv * clip(ratio, 1 - clip_low, 1 + clip_high))

    which is -min(ratio * A, clip(ratio) * A) of the paper: for A > 0 the objective stops growing
    once ratio > 1 + clip_high, for A < 0 once ratio < 1 - clip_low.

    Dual clip (``clip_ratio_c`` = c > 1, verl uses 3.0): for A < 0 the loss is further capped,
    ``loss = min(loss, -A * c)``, so a token whose ratio has run past c gives no gradient.

    Returns ``(loss, metrics)``: ``loss`` has the shape of ``logp``, unreduced and unmasked (reduce
    with ``learner.algos.aggregation``); ``metrics`` are masked means, detached 0-dim tensors:

    - ``approx_kl``: k3 estimator of KL(old || new), mean((ratio - 1) - log ratio), as CleanRL;
    - ``clipfrac``: fraction of entries whose ratio lies outside [1 - clip_low, 1 + clip_high]
      (CleanRL's definition, extended to asymmetric bounds);
    - ``ratio_mean``: mean ratio;
    - ``clipfrac_lower`` (only with ``clip_ratio_c``): fraction of entries with A < 0 where the
      dual-clip cap is active (verl's ``pg_clipfrac_lower``).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = logp - old_logp  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    if clip_ratio_c is not None:
        capped = torch.minimum(loss, -adv * clip_ratio_c)  # [B, T]
        dual_active = (adv < 0) & (loss > -adv * clip_ratio_c)  # [B, T]
        loss = torch.where(adv < 0, capped, loss)  # [B, T]

    with torch.no_grad():
        out_of_range = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        metrics = {
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "clipfrac": masked_mean(out_of_range.to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
        if clip_ratio_c is not None:
            metrics["clipfrac_lower"] = masked_mean(dual_active.to(ratio.dtype), mask)
    return loss, metrics

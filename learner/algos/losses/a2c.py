"""Advantage actor-critic (vanilla policy gradient with a baseline) policy loss.

Mnih et al. (2016), "Asynchronous Methods for Deep Reinforcement Learning", arXiv:1602.01783.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean
from learner.algos.registry import POLICY_LOSSES


@POLICY_LOSSES.register("a2c")
def a2c(
    logp: Tensor,  # [B] or [B, T] log pi_theta(a|s)
    old_logp: Tensor | None,  # same shape: log pi_old, for the approx_kl metric only (or None)
    adv: Tensor,  # same shape (or broadcastable): advantages, treated as constants
    mask: Tensor | None = None,  # same shape, bool (metrics only)
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample policy-gradient loss ``-adv * logp`` (``adv`` detached) and detached metrics.

    Takes ``old_logp`` in the place every ``PolicyLossFn`` does, so a trainer calls every policy
    loss alike; unless it is None, ``approx_kl`` (k3, as in ``ppo_clip``) is reported. Always
    reports ``logp_mean``.
    """
    loss = -adv.detach() * logp  # [B, T]
    with torch.no_grad():
        metrics = {"logp_mean": masked_mean(logp, mask)}
        if old_logp is not None:
            log_ratio = logp - old_logp
            metrics["approx_kl"] = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
    return loss, metrics

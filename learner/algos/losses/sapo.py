"""SAPO: a smooth, temperature-controlled sigmoid gate on the importance ratio instead of clipping.

Gao, Zheng, Chen, Dang, Liu, Yu, Yang, Bai, Zhou, Lin (Qwen team, 2025), "Soft Adaptive Policy
Optimization", arXiv:2511.20347, eq. (5)-(6) and (10)-(12): the token objective is
``f(r_t) * A`` with ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))`` and ``tau = tau_pos`` if A > 0
else ``tau_neg`` (defaults 1.0 / 1.05 as the paper, verl, ms-swift and Trinity-RFT).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean
from learner.algos.registry import POLICY_LOSSES

_MAX_LOG_RATIO = 20.0  # verl clamps log r to [-20, 20] before exp()


@POLICY_LOSSES.register("sapo")
def sapo(
    logp: Tensor,  # [B, T] log pi_theta(y_t | x, y_<t)
    old_logp: Tensor,  # [B, T] log pi_old of the same tokens
    adv: Tensor,  # [B, T] advantages
    mask: Tensor | None = None,  # [B, T] bool (metrics only)
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``-(4 / tau) * sigmoid(tau * (r - 1)) * A`` and detached metrics.

    ``r = exp(logp - old_logp)``; ``d loss / d logp = -A * w * r`` with the gate weight
    ``w = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1)))``: 1 on-policy (r = 1, where the
    gradient equals the unclipped policy gradient) and decaying smoothly off-policy, faster for
    larger tau (the paper recommends tau_neg > tau_pos). Use ``seq-mean-token-mean`` aggregation
    for the paper's ``1/G sum_i 1/|y_i| sum_t``.

    Metrics (masked means, detached): ``approx_kl`` (k3 of old || new), ``ratio_mean``,
    ``gate_weight_mean`` (mean w) and ``clipfrac`` = 1 - gate_weight_mean, the soft analogue of
    PPO's clip fraction (0 on-policy, towards 1 as updates are attenuated).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    log_ratio = torch.clamp(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [B, T] f(r)
    loss = -gate * adv  # [B, T]

    with torch.no_grad():
        sig = torch.sigmoid(tau * (ratio - 1.0))  # [B, T]
        weight = 4.0 * sig * (1.0 - sig)  # [B, T] f'(r)
        gate_weight_mean = masked_mean(weight, mask)
        metrics = {
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "gate_weight_mean": gate_weight_mean,
            "clipfrac": 1.0 - gate_weight_mean,
        }
    return loss, metrics

"""CISPO: REINFORCE with a clipped, stop-gradient importance-sampling weight.

MiniMax (2025), "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
arXiv:2506.13585, §3.1, eq. (4)-(5): ``J = E[ sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) *
A_t * log pi(y_t) ] / sum_i |y_i|``. Every token keeps a gradient; only its weight is clipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean
from learner.algos.registry import POLICY_LOSSES


@POLICY_LOSSES.register("cispo")
def cispo(
    logp: Tensor,  # [B, T] log pi_theta(y_t | x, y_<t)
    old_logp: Tensor,  # [B, T] log pi_old of the same tokens
    adv: Tensor,  # [B, T] advantages
    mask: Tensor | None = None,  # [B, T] bool (metrics only)
    *,
    clip_low: float | None = None,
    clip_high: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``-sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logp`` and metrics.

    ``r = exp(logp - old_logp)``. The gradient is ``-w A`` for every token, w the clipped weight;
    PPO's would be ``-A r`` inside the range and 0 outside it. ``clip_low=None`` imposes no lower
    bound, as the paper ("we did not impose a lower bound on the IS weight ... only tuned
    eps_high"); the paper gives no eps_high value, so the default 5.0 is ScaleRL's (Khatri et al.
    2025, arXiv:2510.13786) and TRL's recommended ``epsilon_high`` for ``loss_type="cispo"``
    (OpenRLHF/Trinity-RFT examples use 0.28). Use ``token-mean`` aggregation for eq. (4).

    Metrics (masked means, detached): ``approx_kl`` (k3 of old || new), ``clipfrac`` (fraction of
    tokens whose weight was clipped), ``ratio_mean`` (unclipped r), ``is_weight_mean`` (w).
    """
    log_ratio = logp - old_logp  # [B, T]
    ratio = torch.exp(log_ratio.detach())  # [B, T] no gradient through the weight
    low = None if clip_low is None else 1.0 - clip_low
    weight = torch.clamp(ratio, min=low, max=1.0 + clip_high)  # [B, T]
    loss = -weight * adv * logp  # [B, T]

    with torch.no_grad():
        metrics = {
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "clipfrac": masked_mean((weight != ratio).to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "is_weight_mean": masked_mean(weight, mask),
        }
    return loss, metrics

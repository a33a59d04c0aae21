"""GSPO: PPO-style clipping of a sequence-level, length-normalised importance ratio.

Zheng et al. (2025), "Group Sequence Policy Optimization", arXiv:2507.18071: eq. (7) (objective),
eq. (8) (``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)``), eq. (13)-(14) (GSPO-token:
``s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]``, same value as s_i, gradient of eq. (11)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean
from learner.algos.registry import POLICY_LOSSES

_MAX_LOG_RATIO = 10.0  # verl caps log s_{i,t} at 10 before exp() to avoid overflow


@POLICY_LOSSES.register("gspo")
def gspo(
    logp: Tensor,  # [B, T] log pi_theta(y_t | x, y_<t)
    old_logp: Tensor,  # [B, T] log pi_old of the same tokens
    adv: Tensor,  # [B, T] advantages (GRPO: constant along a sequence)
    mask: Tensor | None = None,  # [B, T] bool: completion tokens; required (None raises)
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO-token loss (to minimise) and detached metrics.

        s_i     = exp( sum_t m_t (logp_t - old_logp_t) / |y_i| )          (eq. 8, geometric mean)
        s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])                       (eq. 13; value s_i)
        loss    = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

    The default range (3e-4, 4e-4) is the paper's (§5.1). With ``seq-mean-token-mean``
    aggregation and A constant along a sequence, this is eq. (7) and its gradient is eq. (11):
    ``d loss_i / d logp_t = -A_i s_i / |y_i|`` for every token (when not clipped), not the
    token-level ``-A r_t / |y_i|`` of GRPO. ``log s_{i,t}`` is capped at 10 as in verl.

    Metrics (masked token means, detached): ``approx_kl`` (k3 of old || new, per token),
    ``clipfrac`` (tokens whose s_i lies outside the range), ``ratio_mean`` (mean of s_i over
    sequences with at least one token), ``token_ratio_mean`` (mean per-token ratio).
    """
    if mask is None:
        raise ValueError("gspo needs mask: the sequence ratio averages over valid tokens")
    if logp.ndim != 2 or mask.shape != logp.shape:
        raise ValueError(
            f"gspo needs logp and mask of one [B, T] shape, got {tuple(logp.shape)} "
            f"and {tuple(mask.shape)}"
        )
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = logp - old_logp  # [B, T]
    n_tokens = mask.sum(dim=-1)  # [B]
    seq_log_ratio = torch.where(mask, log_ratio, zero).sum(-1) / n_tokens.clamp(min=1)  # [B]
    log_s = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [B, T] value log s_i
    s = torch.exp(torch.clamp(log_s, max=_MAX_LOG_RATIO))  # [B, T]
    unclipped = -adv * s  # [B, T]
    clipped = -adv * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]

    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)  # [B, T]
        out_of_range = (s < 1.0 - clip_low) | (s > 1.0 + clip_high)  # [B, T]
        metrics = {
            "approx_kl": masked_mean((token_ratio - 1.0) - log_ratio, mask),
            "clipfrac": masked_mean(out_of_range.to(s.dtype), mask),
            "ratio_mean": masked_mean(torch.exp(seq_log_ratio), n_tokens > 0),
            "token_ratio_mean": masked_mean(token_ratio, mask),
        }
    return loss, metrics

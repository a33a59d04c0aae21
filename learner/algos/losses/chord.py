"""CHORD: an SFT loss on expert data mixed into the RL loss with a scheduled weight mu.

Zhang et al. (2025), "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning
and Reinforcement Learning via Dynamic Weighting", arXiv:2508.11408: the global mix
``L = (1 - mu) L_RL + mu L_SFT`` (CHORD-mu, mu decayed from a peak to a valley, see
``learner.algos.schedules.warmup_cosine``) and the token weight ``phi(p) = p (1 - p)`` on the SFT
loss (CHORD-phi), which damps tokens the policy already finds certain (p -> 1) or very unlikely
(p -> 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sft_loss(
    logp: Tensor,  # [B, T] log pi_theta(y*_t | x, y*_<t) of the expert tokens
    mask: Tensor | None,  # [B, T] bool: expert completion tokens
    *,
    phi: bool = False,
) -> Tensor:
    """Per-token SFT loss ``-logp`` (negative log-likelihood), zero where ``mask`` is false.

    With ``phi=True`` (CHORD-phi) the loss is ``-sg[p (1 - p)] * logp`` with ``p = exp(logp)``;
    the weight is detached, so the gradient is ``-p (1 - p)`` times that of the NLL. Reduce with
    ``learner.algos.aggregation`` (the paper uses token-mean).
    """
    loss = -logp  # [B, T]
    if phi:
        p = torch.exp(logp.detach())  # [B, T]
        loss = p * (1.0 - p) * loss  # [B, T]
    if mask is None:
        return loss
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return torch.where(mask.bool(), loss, zero)  # [B, T]


def chord_mix(rl_loss: Tensor, sft_loss: Tensor, mu: float) -> Tensor:
    """``(1 - mu) * rl_loss + mu * sft_loss`` for scalar (aggregated) losses, ``mu`` in [0, 1]."""
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"mu must lie in [0, 1], got {mu}")
    return (1.0 - mu) * rl_loss + mu * sft_loss

"""Truncated importance sampling (TIS) for the rollout engine / learner mismatch.

Yao, Liu, Zhang, Jiao, Gao (2025), "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", blog post (fengyao.notion.site), and verl's ``rollout_is`` (token level, truncation):
the sampler (e.g. vLLM, bf16/fp8 kernels) and the learner compute different probabilities for the
same policy, so the tokens are off-policy for the learner; weight each token's loss by
``min(pi_learner_old / pi_rollout, cap)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean


@torch.no_grad()
def truncated_is_weights(
    learner_old_logp: Tensor,  # [B, T] log pi_old recomputed by the learner
    rollout_logp: Tensor,  # [B, T] log-probs the sampler reported for the same tokens
    mask: Tensor | None,  # [B, T] bool: completion tokens
    *,
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached weights ``[B, T] = min(exp(learner_old - rollout), cap)``, 0 where mask is false.

    The caller multiplies the per-token policy loss by them before aggregating. Metrics (masked
    means): ``mismatch_kl`` (k3 estimate of KL(rollout || learner) from the rollout's samples:
    ``mean(w - 1 - log w)`` with the untruncated ``w``), ``tis_weight_mean`` (truncated weights),
    ``tis_clipfrac`` (fraction of tokens whose weight exceeded ``cap``).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_w = learner_old_logp - rollout_logp  # [B, T]
    w = torch.exp(log_w)  # [B, T]
    weights = torch.clamp(w, max=cap)  # [B, T]
    if mask is not None:
        weights = torch.where(mask.bool(), weights, torch.zeros_like(weights))  # [B, T]
    metrics = {
        "mismatch_kl": masked_mean(w - 1.0 - log_w, mask),
        "tis_weight_mean": masked_mean(weights, mask),
        "tis_clipfrac": masked_mean((w > cap).to(w.dtype), mask),
    }
    return weights, metrics

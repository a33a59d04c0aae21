"""Entropy bonus: a loss term whose minimisation raises the policy's entropy."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution over the last axis: ``[..., V] -> [...]``.

    ``H = logsumexp(z) - sum(softmax(z) * z)``, which avoids forming log-probabilities.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_loss(
    entropy: Tensor,  # [B] or [B, T] per-sample policy entropy
    mask: Tensor | None = None,  # same shape, bool (metrics only)
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample loss ``-entropy`` (add ``ent_coef * aggregate(loss)`` to the total) and the
    detached metric ``entropy`` (masked mean)."""
    with torch.no_grad():
        metrics = {"entropy": masked_mean(entropy, mask)}
    return -entropy, metrics

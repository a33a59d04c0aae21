"""Direct Preference Optimization and two of its loss variants (IPO, hinge), as TRL's DPOTrainer.

Rafailov et al. (2023), "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model", arXiv:2305.18290, eq. (7); label smoothing as conservative DPO (Mitchell 2023, "A note on
DPO with noisy preferences"); IPO: Azar et al. (2023), arXiv:2310.12036, eq. (17); hinge: SLiC,
Zhao et al. (2023), arXiv:2305.10425.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(
    chosen_logp: Tensor,  # [B] log pi_theta(y_w | x): sum over the completion's tokens
    rejected_logp: Tensor,  # [B] log pi_theta(y_l | x)
    ref_chosen_logp: Tensor,  # [B] log pi_ref(y_w | x)
    ref_rejected_logp: Tensor,  # [B] log pi_ref(y_l | x)
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair loss ``[B]`` and TRL's detached metrics.

    With ``h = (chosen - rejected) - (ref_chosen - ref_rejected)`` (log-ratio margin):

    - ``sigmoid`` (DPO): ``-(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)``;
    - ``ipo``: ``(h - 1 / (2 beta))^2`` (TRL passes length-averaged log-probs for IPO);
    - ``hinge``: ``relu(1 - beta h)``.

    Metrics (batch means): ``rewards/chosen`` = beta (chosen - ref_chosen), ``rewards/rejected``
    likewise, ``rewards/accuracies`` = fraction with chosen reward > rejected reward,
    ``rewards/margins`` = chosen reward - rejected reward.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
    logits = (chosen_logp - rejected_logp) - (ref_chosen_logp - ref_rejected_logp)  # [B]
    if loss_type == "sigmoid":
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits) - (
            label_smoothing * F.logsigmoid(-beta * logits)
        )  # [B]
    elif loss_type == "ipo":
        loss = (logits - 1.0 / (2.0 * beta)) ** 2  # [B]
    else:
        loss = torch.relu(1.0 - beta * logits)  # [B]

    with torch.no_grad():
        chosen_rewards = beta * (chosen_logp - ref_chosen_logp)  # [B]
        rejected_rewards = beta * (rejected_logp - ref_rejected_logp)  # [B]
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(logits.dtype).mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        }
    return loss, metrics

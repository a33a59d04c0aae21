"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta.

Schulman (2020), "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. With
``log_r = ref_logp - logp`` (log pi_ref / pi_theta of the sampled token):

- ``k1 = -log_r``: unbiased, high variance, can be negative (the REINFORCE++ reward penalty);
- ``k2 = log_r^2 / 2``: biased, low variance, >= 0;
- ``k3 = exp(log_r) - log_r - 1``: unbiased, low variance, >= 0 (GRPO's KL loss, DeepSeekMath
  arXiv:2402.03300 eq. (4)); its gradient w.r.t. logp is ``1 - pi_ref / pi_theta``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp  # [B, T]


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2  # [B, T]


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    log_r = ref_logp - logp  # [B, T]
    return torch.exp(log_r) - log_r - 1.0  # [B, T]


def kl_penalty(
    logp: Tensor,  # [B, T] log pi_theta of the sampled tokens
    ref_logp: Tensor,  # [B, T] log pi_ref of the same tokens (frozen reference model)
    *,
    estimator: str = "k3",
    clamp: float | None = None,
) -> Tensor:
    """Per-token KL estimate ``[B, T]`` with the named estimator (``KL_ESTIMATORS``).

    Differentiable w.r.t. ``logp`` (use it as a loss term: ``kl_beta * aggregate(kl, mask)``), or
    detach it for a reward penalty. ``clamp`` bounds the result to ``[-clamp, clamp]`` (verl clamps
    ``low_var_kl``, its k3, to [-10, 10]). Entries outside the completion mask are not zeroed.
    """
    kl = KL_ESTIMATORS.get(estimator)(logp, ref_logp)  # [B, T]
    if clamp is not None:
        kl = torch.clamp(kl, -clamp, clamp)  # [B, T]
    return kl

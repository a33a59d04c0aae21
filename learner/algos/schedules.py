"""Scalar schedules (learning rate, entropy coefficient, ...) as functions of the update step.

Every schedule has the signature ``f(step, total, start, end=0.0) -> float`` and is registered in
``SCHEDULES`` ("constant", "linear", "cosine", "warmup_cosine"); extra hyperparameters are
keyword-only (``warmup_cosine``'s ``warmup``).
"""

from __future__ import annotations

import math

from learner.algos.registry import SCHEDULES


@SCHEDULES.register("linear")
def linear_anneal(step: int, total: int, start: float, end: float = 0.0) -> float:
    """``start + (end - start) * min(step / total, 1)``: ``start`` at step 0, ``end`` at ``total``.

    CleanRL's ``anneal_lr`` (``lr * (1 - (iteration - 1) / num_iterations)`` for iterations
    1..num_iterations) is ``linear_anneal(iteration - 1, num_iterations, lr)``.
    """
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    frac = min(step / total, 1.0)
    return start + (end - start) * frac


@SCHEDULES.register("constant")
def constant(step: int, total: int, start: float, end: float = 0.0) -> float:
    """Always ``start`` (``step``, ``total`` and ``end`` are accepted for a common signature)."""
    return start


@SCHEDULES.register("cosine")
def cosine_decay(step: int, total: int, start: float, end: float = 0.0) -> float:
    """``end + (start - end) * (1 + cos(pi * min(step / total, 1))) / 2``: ``start`` at step 0,
    ``end`` from ``total`` on (half-cosine, Loshchilov & Hutter 2017, arXiv:1608.03983)."""
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    frac = min(step / total, 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))


@SCHEDULES.register("warmup_cosine")
def warmup_cosine(
    step: int, total: int, start: float, end: float = 0.0, *, warmup: int = 0
) -> float:
    """Linear warm-up from 0 to ``start`` over ``warmup`` steps, then ``cosine_decay`` from
    ``start`` to ``end`` over the remaining ``total - warmup`` steps, then ``end``.

    CHORD's mu schedule (Zhang et al. 2025, arXiv:2508.11408; ``mu_warmup_steps``,
    ``mu_decay_steps``, ``mu_peak``, ``mu_valley`` in Trinity-RFT / ms-swift) is
    ``warmup_cosine(step, warmup + decay, mu_peak, mu_valley, warmup=warmup)``.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if not 0 <= warmup <= total:
        raise ValueError(f"warmup must lie in [0, total={total}], got {warmup}")
    if step < warmup:
        return start * step / warmup
    if total == warmup:
        return end
    return cosine_decay(step - warmup, total - warmup, start, end)

"""Scalar schedules (learning rate, entropy coefficient, ...) as functions of the update step.

Every schedule has the signature ``f(step, total, start, end=0.0) -> float`` and is registered in
``SCHEDULES`` ("constant", "linear").
"""

from __future__ import annotations

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

"""Advantage estimators, registered in ``ADVANTAGES`` (game RL: ``gae``)."""

from learner.algos.advantages.gae import discounted_returns, gae

__all__ = ["discounted_returns", "gae"]

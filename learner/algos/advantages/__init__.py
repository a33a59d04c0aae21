"""Advantage estimators, registered in ``ADVANTAGES``: game RL (``gae``) and the group-relative
LM estimators (``grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``), which share
``f(rewards [B], group_ids [B], mask [B, T], **hp) -> (advantages [B, T], metrics)``."""

from learner.algos.advantages.gae import discounted_returns, gae
from learner.algos.advantages.grpo import grpo
from learner.algos.advantages.reinforce_pp import reinforce_pp, reinforce_pp_baseline, token_returns
from learner.algos.advantages.rloo import rloo

__all__ = [
    "discounted_returns",
    "gae",
    "grpo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "token_returns",
]

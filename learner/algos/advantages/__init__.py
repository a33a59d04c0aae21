"""Advantage estimators, two families: game RL over rollout fragments (``gae``, ``vtrace``,
registered in ``GAME_ADVANTAGES``, protocol ``GameAdvantageFn``) and the group-relative LM
estimators (``grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, in
``GROUP_ADVANTAGES``, protocol ``GroupAdvantageFn``: ``f(rewards [B], group_ids [B], mask [B, T],
**hp) -> (advantages [B, T], metrics)``)"""

from learner.algos.advantages.gae import discounted_returns, gae
from learner.algos.advantages.grpo import grpo
from learner.algos.advantages.reinforce_pp import reinforce_pp, reinforce_pp_baseline, token_returns
from learner.algos.advantages.rloo import rloo
from learner.algos.advantages.vtrace import VTrace, vtrace, vtrace_advantages

__all__ = [
    "VTrace",
    "discounted_returns",
    "gae",
    "grpo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "token_returns",
    "vtrace",
    "vtrace_advantages",
]

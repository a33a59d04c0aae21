"""Policy, value, entropy, SFT and preference losses. Policy losses (``POLICY_LOSSES``, protocol
``PolicyLossFn``: ``f(logp, old_logp, adv, mask=None, **hp)``) return ``(per-sample loss, detached
metrics)``; the others have one implementation each and are called directly."""

from learner.algos.losses.a2c import a2c
from learner.algos.losses.chord import chord_mix, sft_loss
from learner.algos.losses.cispo import cispo
from learner.algos.losses.dpo import dpo_loss
from learner.algos.losses.entropy import entropy_from_logits, entropy_loss
from learner.algos.losses.gspo import gspo
from learner.algos.losses.ppo import ppo_clip
from learner.algos.losses.sapo import sapo
from learner.algos.losses.value import value_loss

__all__ = [
    "a2c",
    "chord_mix",
    "cispo",
    "dpo_loss",
    "entropy_from_logits",
    "entropy_loss",
    "gspo",
    "ppo_clip",
    "sapo",
    "sft_loss",
    "value_loss",
]

"""Policy, value and entropy losses. Each returns ``(per-sample loss, detached metrics)``."""

from learner.algos.losses.a2c import a2c
from learner.algos.losses.entropy import entropy_from_logits, entropy_loss
from learner.algos.losses.ppo import ppo_clip
from learner.algos.losses.value import value_loss

__all__ = ["a2c", "entropy_from_logits", "entropy_loss", "ppo_clip", "value_loss"]

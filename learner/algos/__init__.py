"""The pure algorithm layer: advantage estimators, policy/value/entropy losses, aggregation,
normalisation and schedules, each a small function registered by name (see ``registry``).

Importing this package registers the built-ins; ``rlfleet.algos`` entry-point plugins load on the
first registry lookup.
"""

from learner.algos.advantages import discounted_returns, gae
from learner.algos.aggregate import aggregate, masked_mean
from learner.algos.losses import a2c, entropy_from_logits, entropy_loss, ppo_clip, value_loss
from learner.algos.normalize import normalize_advantages
from learner.algos.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    POLICY_LOSSES,
    SCHEDULES,
    VALUE_LOSSES,
    DuplicateNameError,
    PluginLoadError,
    Registry,
    UnknownNameError,
    load_plugins,
)
from learner.algos.schedules import constant, linear_anneal

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "SCHEDULES",
    "VALUE_LOSSES",
    "DuplicateNameError",
    "PluginLoadError",
    "Registry",
    "UnknownNameError",
    "a2c",
    "aggregate",
    "constant",
    "discounted_returns",
    "entropy_from_logits",
    "entropy_loss",
    "gae",
    "linear_anneal",
    "load_plugins",
    "masked_mean",
    "normalize_advantages",
    "ppo_clip",
    "value_loss",
]

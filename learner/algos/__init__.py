"""The pure algorithm layer: advantage estimators, policy/value/entropy/SFT/preference losses,
KL estimators, truncated importance sampling, DAPO filters, aggregation, normalisation, schedules
and named presets, each a small pure function. The families a preset chooses from by name
(advantages, policy losses, aggregations, KL estimators, schedules) are typed registries, one
``Protocol`` each (see ``registry`` and ``protocols``); the rest are called directly.

Importing this package registers the built-ins; ``rlfleet.algos`` entry-point plugins load on the
first registry lookup.
"""

from learner.algos.advantages import (
    discounted_returns,
    gae,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    token_returns,
    vtrace,
    vtrace_advantages,
)
from learner.algos.aggregate import aggregate, masked_mean
from learner.algos.filters import dynamic_sampling_keep, overlong_mask
from learner.algos.kl import kl_penalty
from learner.algos.losses import (
    a2c,
    chord_mix,
    cispo,
    dpo_loss,
    entropy_from_logits,
    entropy_loss,
    gspo,
    ppo_clip,
    sapo,
    sft_loss,
    value_loss,
)
from learner.algos.normalize import normalize_advantages
from learner.algos.presets import GamePreset, Preset, resolve_game_preset, resolve_preset
from learner.algos.protocols import (
    AggregationFn,
    GameAdvantageFn,
    GroupAdvantageFn,
    KLEstimatorFn,
    PolicyLossFn,
    ScheduleFn,
)
from learner.algos.registry import (
    AGGREGATIONS,
    GAME_ADVANTAGES,
    GAME_PRESETS,
    GROUP_ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    SCHEDULES,
    DuplicateNameError,
    PluginLoadError,
    Registry,
    SignatureError,
    UnknownNameError,
    WrongFamilyError,
    check_signature,
    load_plugins,
)
from learner.algos.schedules import constant, cosine_decay, linear_anneal, warmup_cosine
from learner.algos.tis import truncated_is_weights

__all__ = [
    "AGGREGATIONS",
    "GAME_ADVANTAGES",
    "GAME_PRESETS",
    "GROUP_ADVANTAGES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "SCHEDULES",
    "AggregationFn",
    "DuplicateNameError",
    "GameAdvantageFn",
    "GamePreset",
    "GroupAdvantageFn",
    "KLEstimatorFn",
    "PluginLoadError",
    "PolicyLossFn",
    "Preset",
    "Registry",
    "ScheduleFn",
    "SignatureError",
    "UnknownNameError",
    "WrongFamilyError",
    "a2c",
    "aggregate",
    "check_signature",
    "chord_mix",
    "cispo",
    "constant",
    "cosine_decay",
    "discounted_returns",
    "dpo_loss",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "entropy_loss",
    "gae",
    "grpo",
    "gspo",
    "kl_penalty",
    "linear_anneal",
    "load_plugins",
    "masked_mean",
    "normalize_advantages",
    "overlong_mask",
    "ppo_clip",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "resolve_game_preset",
    "resolve_preset",
    "rloo",
    "sapo",
    "sft_loss",
    "token_returns",
    "truncated_is_weights",
    "value_loss",
    "vtrace",
    "vtrace_advantages",
    "warmup_cosine",
]

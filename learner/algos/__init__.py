"""The pure algorithm layer: advantage estimators, policy/value/entropy/SFT/preference losses,
KL estimators, truncated importance sampling, DAPO filters, aggregation, normalisation, schedules
and named presets, each a small pure function. The families a preset chooses from by name
(advantages, policy losses, aggregations, KL estimators, schedules) are typed registries, one
``Protocol`` each (see ``registry`` and ``protocols``); the rest are called directly.

The registries, presets and protocols import without torch; the functions (torch) are imported
when first named (``learner.algos.gae``) or when a registry is first looked up, which registers
the built-ins and then loads the ``rlfleet.algos`` entry-point plugins (``load_plugins``). So
``rlfleet up`` and ``rlfleet validate`` check a built-in game ``algo`` or LM ``preset`` without
importing torch (``presets.builtin_game_preset`` / ``builtin_preset``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    BUILTIN_MODULES,
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

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers
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
    from learner.algos.aggregation import aggregate, masked_mean
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
    from learner.algos.schedules import constant, cosine_decay, linear_anneal, warmup_cosine
    from learner.algos.tis import truncated_is_weights

# Where the functions live: the registering modules, and those called directly.
_FUNCTION_MODULES = (
    *BUILTIN_MODULES,
    "learner.algos.filters",
    "learner.algos.normalize",
    "learner.algos.tis",
)


def __getattr__(name: str) -> Any:
    """A function of ``__all__``, imported on first use (PEP 562)."""
    if name in __all__:
        for module in map(importlib.import_module, _FUNCTION_MODULES):
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value  # later lookups are plain attribute reads
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


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

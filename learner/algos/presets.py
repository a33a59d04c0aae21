"""Named algorithm presets: which advantage estimator, policy loss, aggregation and extras a
recipe (GRPO, DAPO, Dr. GRPO, GSPO, ...) combines, with the hyperparameters its paper uses.

A preset is data only; the trainer reads it:

- ``advantage(rewards, group_ids, mask, **advantage_kwargs)`` (``ADVANTAGES``);
- ``policy_loss(logp, old_logp, adv, mask, **loss_kwargs)`` (``POLICY_LOSSES``), reduced with
  ``aggregate(loss, mask, aggregation, **aggregation_kwargs)``;
- ``kl_beta > 0`` needs a frozen reference model: with ``kl_in_reward`` the per-token penalty
  ``-kl_beta * kl_penalty(old_logp, ref_logp, estimator=kl_estimator)`` goes to the advantage as
  ``token_rewards`` (REINFORCE++); otherwise ``kl_beta * aggregate(kl_penalty(logp, ref_logp))``
  is added to the loss (GRPO);
- ``entropy_coef``: weight of ``entropy_loss`` (0 = none);
- ``dynamic_sampling`` / ``overlong_filter``: DAPO's ``learner.algos.filters``;
- ``tis_cap``: truncated importance sampling against the sampler's log-probs
  (``learner.algos.tis``), None = off;
- ``chord``: mix an SFT loss on expert data, ``chord_mix(rl, sft, mu=preset.chord_mu(step))``.

``resolve_preset(name, **overrides)`` returns a validated copy with fields replaced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.algos.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    SCHEDULES,
    Registry,
)

# (name field, kwargs field, registry, leading tensor arguments that are not hyperparameters)
_COMPONENTS: tuple[tuple[str, str, Registry[Any], int], ...] = (
    ("advantage", "advantage_kwargs", ADVANTAGES, 3),  # rewards, group_ids, mask
    ("policy_loss", "loss_kwargs", POLICY_LOSSES, 4),  # logp, old_logp, adv, mask
    ("aggregation", "aggregation_kwargs", AGGREGATIONS, 2),  # loss, mask
)


class Preset(BaseModel):
    """One algorithm recipe. Frozen; names are checked against the registries, kwargs against the
    named function's keyword parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    advantage: str
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict)
    policy_loss: str
    loss_kwargs: dict[str, Any] = Field(default_factory=dict)
    aggregation: str
    aggregation_kwargs: dict[str, float] = Field(default_factory=dict)
    kl_beta: float = Field(0.0, ge=0.0)
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    tis_cap: float | None = Field(None, gt=0.0)
    chord: bool = False
    chord_phi: bool = False
    chord_schedule: str = "warmup_cosine"
    chord_mu_peak: float = Field(0.9, ge=0.0, le=1.0)
    chord_mu_valley: float = Field(0.05, ge=0.0, le=1.0)
    chord_warmup_steps: int = Field(0, ge=0)
    chord_decay_steps: int = Field(200, ge=1)

    @model_validator(mode="after")
    def _check_names(self) -> Preset:
        for name_field, kwargs_field, registry, n_tensors in _COMPONENTS:
            fn = registry.get(getattr(self, name_field))  # UnknownNameError lists known names
            _check_kwargs(fn, getattr(self, kwargs_field), n_tensors, kwargs_field)
        KL_ESTIMATORS.get(self.kl_estimator)
        SCHEDULES.get(self.chord_schedule)
        if self.kl_in_reward:
            params = inspect.signature(ADVANTAGES.get(self.advantage)).parameters
            if "token_rewards" not in params:
                raise ValueError(
                    f"kl_in_reward needs an advantage estimator that takes token_rewards "
                    f"(reinforce_pp, reinforce_pp_baseline), not {self.advantage!r}"
                )
        return self

    def chord_mu(self, step: int) -> float:
        """CHORD's mu at update ``step`` from ``chord_schedule`` (peak -> valley)."""
        fn = SCHEDULES.get(self.chord_schedule)
        total = self.chord_warmup_steps + self.chord_decay_steps
        args = (step, total, self.chord_mu_peak, self.chord_mu_valley)
        if "warmup" in inspect.signature(fn).parameters:
            return fn(*args, warmup=self.chord_warmup_steps)
        return fn(*args)


def _check_kwargs(
    fn: Callable[..., Any], kwargs: dict[str, Any], n_tensors: int, where: str
) -> None:
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    valid = [
        p.name
        for p in params[n_tensors:]
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    for key in kwargs:
        if key not in valid:
            raise ValueError(
                f"{where}: {fn.__name__}() has no hyperparameter {key!r}; "
                f"valid: {', '.join(valid) or 'none'}"
            )


def resolve_preset(name: str, **overrides: Any) -> Preset:
    """The preset ``name`` with ``overrides`` applied, validated.

    An unknown override name raises ``ValueError`` naming it and listing the valid ones. The
    ``*_kwargs`` dicts are merged key by key into the preset's, unless the override also changes
    the function they belong to (e.g. ``policy_loss="cispo"``): then they start empty.
    """
    base = PRESETS.get(name)
    valid = list(Preset.model_fields)
    for key in overrides:
        if key not in Preset.model_fields:
            raise ValueError(
                f"unknown override {key!r} for preset {name!r}; valid: {', '.join(valid)}"
            )
    data = base.model_dump()
    for name_field, kwargs_field, _, _ in _COMPONENTS:
        if overrides.get(name_field, data[name_field]) != data[name_field]:
            data[kwargs_field] = {}
        if kwargs_field in overrides:
            data[kwargs_field] = {**data[kwargs_field], **overrides.pop(kwargs_field)}
    return Preset.model_validate({**data, **overrides})


def _add(name: str, **fields: Any) -> None:
    # Built without validation: validating looks names up in the registries, which loads the
    # rlfleet.algos plugins, and that must not happen while learner.algos is being imported.
    # resolve_preset validates; tests resolve every built-in preset.
    PRESETS.add(name, Preset.model_construct(**fields))


# DeepSeekMath (arXiv:2402.03300) §4.2/§5.2.1: eps = 0.2, beta = 0.04 with the k3 KL as a loss
# term, per-sequence mean (eq. 3). TRL's GRPOConfig shipped beta = 0.04 at first (now 0.0).
_add(
    "grpo",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2},
    aggregation="seq-mean-token-mean",
    kl_beta=0.04,
    kl_estimator="k3",
)
# DAPO (arXiv:2503.14476) §3-4: clip-higher 0.2/0.28, token-level loss, no KL, dynamic sampling,
# overlong filtering (the soft overlong punishment is a reward, not set here).
_add(
    "dapo",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2, "clip_high": 0.28},
    aggregation="token-mean",
    dynamic_sampling=True,
    overlong_filter=True,
)
# Dr. GRPO (arXiv:2503.20783) §3.2: no std normalisation, no length normalisation (divide by a
# constant: set aggregation_kwargs={"norm": max_new_tokens}), no KL.
_add(
    "dr_grpo",
    advantage="grpo",
    advantage_kwargs={"norm_std": False},
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2},
    aggregation="seq-mean-token-sum-norm",
)
# GSPO (arXiv:2507.18071) §5.1: GRPO advantages, sequence ratio clipped to (3e-4, 4e-4), no KL;
# the sequence-level objective is a per-sequence mean.
_add(
    "gspo",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="gspo",
    loss_kwargs={"clip_low": 3e-4, "clip_high": 4e-4},
    aggregation="seq-mean-token-mean",
)
# SAPO (arXiv:2511.20347): tau_pos 1.0, tau_neg 1.05, 1/G sum_i 1/|y_i| sum_t, no KL.
_add(
    "sapo",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="sapo",
    loss_kwargs={"tau_pos": 1.0, "tau_neg": 1.05},
    aggregation="seq-mean-token-mean",
)
# CISPO (MiniMax-M1, arXiv:2506.13585) eq. (4): group-normalised advantages, token-level mean,
# no lower bound on the IS weight; eps_high 5.0 as ScaleRL/TRL (the paper gives no value).
_add(
    "cispo",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="cispo",
    loss_kwargs={"clip_low": None, "clip_high": 5.0},
    aggregation="token-mean",
)
# RLOO (arXiv:2402.14740) advantages with the PPO surrogate (as TRL's RLOOTrainer), no KL.
_add(
    "rloo",
    advantage="rloo",
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2},
    aggregation="token-mean",
)
# REINFORCE++ (arXiv:2501.03262): k1 KL penalty in the token reward (OpenRLHF init_kl_coef 0.01),
# global whitening, PPO clip 0.2, token-level mean.
_add(
    "reinforce_pp",
    advantage="reinforce_pp",
    advantage_kwargs={"gamma": 1.0},
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2},
    aggregation="token-mean",
    kl_beta=0.01,
    kl_estimator="k1",
    kl_in_reward=True,
)
# CHORD-mu (arXiv:2508.11408): GRPO + SFT on expert data, mu cosine-decayed 0.9 -> 0.05 over 200
# steps without warm-up (the Trinity-RFT / ms-swift example values), no KL.
_add(
    "chord",
    advantage="grpo",
    advantage_kwargs={"norm_std": True},
    policy_loss="ppo",
    loss_kwargs={"clip_low": 0.2},
    aggregation="token-mean",
    chord=True,
    chord_phi=False,
    chord_schedule="warmup_cosine",
    chord_mu_peak=0.9,
    chord_mu_valley=0.05,
    chord_warmup_steps=0,
    chord_decay_steps=200,
)

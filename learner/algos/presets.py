"""Named algorithm presets: which functions of which family a recipe combines, with the
hyperparameters its paper uses. Two kinds, each validated against the typed registries
(``learner.algos.registry``), so a name of the wrong family fails here, naming the field:

``Preset`` (LM RL, ``PRESETS``: GRPO, DAPO, Dr. GRPO, GSPO, ...), data only; the LM learner reads:

- ``advantage(rewards, group_ids, mask, **advantage_kwargs)`` (``GROUP_ADVANTAGES``);
- ``policy_loss(logp, old_logp, adv, mask, **loss_kwargs)`` (``POLICY_LOSSES``), reduced with
  ``aggregate(loss, mask, aggregation, **aggregation_kwargs)`` (``AGGREGATIONS``);
- ``kl_beta > 0`` needs a frozen reference model: with ``kl_in_reward`` the per-token penalty
  ``-kl_beta * kl_penalty(old_logp, ref_logp, estimator=kl_estimator)`` goes to the advantage as
  ``token_rewards`` (REINFORCE++); otherwise ``kl_beta * aggregate(kl_penalty(logp, ref_logp))``
  is added to the loss (GRPO);
- ``entropy_coef``: weight of ``entropy_loss`` (0 = none);
- ``dynamic_sampling`` / ``overlong_filter``: DAPO's ``learner.algos.filters``;
- ``old_logp``: which log-probs are pi_old in the policy ratio (see ``OldLogp``); ``auto``
  corrects stale batches against the sampler's log-probs;
- ``tis_cap``: truncated importance sampling of the rows whose pi_old the learner recomputed,
  against the sampler's log-probs (``learner.algos.tis``), None = off;
- ``chord``: mix an SFT loss on expert data, ``chord_mix(rl, sft, mu=preset.chord_mu(step))``.

``GamePreset`` (game RL, ``GAME_PRESETS``: ``ppo``, ``a2c``, ``appo``; ``LearnerSettings.algo``
names one):

- ``advantage(rewards, values, terminated=, truncated=, last_value=, final_values=, gamma=,
  lam=, bootstrap_truncated=, **advantage_kwargs)`` (``GAME_ADVANTAGES``); an estimator that
  takes ``behaviour_logp`` / ``target_logp`` (``vtrace``) also gets the actors' log-probs and
  the learner's current ones;
- ``policy_loss(logp=, old_logp=, adv=, **preset.policy_loss_kwargs(settings))``
  (``POLICY_LOSSES``): fixed ``loss_kwargs`` plus ``loss_knobs``, hyperparameters whose value is
  a ``LearnerSettings`` field (PPO's ``clip_low`` is the ``clip_coef`` knob).

``resolve_preset(name, **overrides)`` / ``resolve_game_preset(name)`` return validated copies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.algos.registry import (
    AGGREGATIONS,
    GAME_ADVANTAGES,
    GAME_PRESETS,
    GROUP_ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    SCHEDULES,
    Registry,
    plugins_installed,
)

__all__ = [
    "GamePreset",
    "OldLogp",
    "Preset",
    "builtin_game_preset",
    "builtin_preset",
    "resolve_game_preset",
    "resolve_preset",
]

# pi_old of the policy ratio, per row of a batch:
# - "behaviour": the sampler's log-probs (TrajectoryCompletion.logprobs) for every row: the ratio
#   is against the policy that really sampled, whatever its version (PPO's own definition), and
#   includes the sampler/learner numeric mismatch; no extra forward pass.
# - "recompute": the learner's current weights for every row (verl/TRL's on-policy default): the
#   first minibatch's ratio is exactly 1, so a batch from an older version is trained as if
#   on-policy; with ``tis_cap`` the truncated weights pi_recomputed / pi_sampler correct it
#   (AReaL's decoupled objective: proximal policy recomputed, behaviour correction by TIS).
# - "auto" (the default): "behaviour" for rows sampled by a version older than the learner's
#   (the staleness is corrected by the clipped ratio), "recompute" for the rest (their ratio
#   starts at 1, ``tis_cap`` corrects the sampler/learner mismatch and ``rollout/mismatch_kl``
#   measures it); the forward pass runs on those rows only.
OldLogp = Literal["auto", "behaviour", "recompute"]

# (name field, kwargs field, registry of the family the name must come from)
_COMPONENTS: tuple[tuple[str, str, Registry[Any]], ...] = (
    ("advantage", "advantage_kwargs", GROUP_ADVANTAGES),
    ("policy_loss", "loss_kwargs", POLICY_LOSSES),
    ("aggregation", "aggregation_kwargs", AGGREGATIONS),
)


class Preset(BaseModel):
    """One LM algorithm recipe. Frozen; each name is looked up in its family's registry (a name
    of another family fails, naming the field), kwargs are checked against the named function's
    hyperparameters."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # as settings

    advantage: str  # GROUP_ADVANTAGES
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict)
    policy_loss: str  # POLICY_LOSSES
    loss_kwargs: dict[str, Any] = Field(default_factory=dict)
    aggregation: str  # AGGREGATIONS
    aggregation_kwargs: dict[str, float] = Field(default_factory=dict)
    kl_beta: float = Field(0.0, ge=0.0)
    kl_estimator: str = "k3"  # KL_ESTIMATORS
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    old_logp: OldLogp = "auto"
    tis_cap: float | None = Field(None, gt=0.0)
    chord: bool = False
    chord_phi: bool = False
    chord_schedule: str = "warmup_cosine"  # SCHEDULES
    chord_mu_peak: float = Field(0.9, ge=0.0, le=1.0)
    chord_mu_valley: float = Field(0.05, ge=0.0, le=1.0)
    chord_warmup_steps: int = Field(0, ge=0)
    chord_decay_steps: int = Field(200, ge=1)

    @model_validator(mode="after")
    def _check_names(self) -> Preset:
        # UnknownNameError (WrongFamilyError for another family's name) names the field
        for name_field, kwargs_field, registry in _COMPONENTS:
            name = getattr(self, name_field)
            registry.get(name, field=name_field)
            registry.check_kwargs(name, getattr(self, kwargs_field), field=kwargs_field)
        KL_ESTIMATORS.get(self.kl_estimator, field="kl_estimator")
        SCHEDULES.get(self.chord_schedule, field="chord_schedule")
        if self.tis_cap is not None and self.old_logp == "behaviour":
            raise ValueError(
                "tis_cap weights rows whose pi_old the learner recomputed; with old_logp="
                "'behaviour' none is (the ratio is against the sampler's log-probs already): "
                "use old_logp 'auto' or 'recompute', or drop tis_cap"
            )
        if self.kl_in_reward and not _takes(self.advantage, "token_rewards"):
            able = [n for n in GROUP_ADVANTAGES.names() if _takes(n, "token_rewards")]
            raise ValueError(
                f"kl_in_reward needs an advantage estimator that takes token_rewards "
                f"({', '.join(able)}), not {self.advantage!r}"
            )
        return self

    def chord_mu(self, step: int) -> float:
        """CHORD's mu at update ``step`` from ``chord_schedule`` (peak -> valley)."""
        fn = SCHEDULES.get(self.chord_schedule)
        total = self.chord_warmup_steps + self.chord_decay_steps
        args = (step, total, self.chord_mu_peak, self.chord_mu_valley)
        if "warmup" in (SCHEDULES.hyperparameters(self.chord_schedule) or ()):
            return fn(*args, warmup=self.chord_warmup_steps)
        return fn(*args)


def _takes(advantage: str, keyword: str) -> bool:
    valid = GROUP_ADVANTAGES.hyperparameters(advantage)
    return valid is None or keyword in valid


class GamePreset(BaseModel):
    """One game-RL recipe. Frozen; names are looked up in their family's registry, and every
    ``loss_kwargs`` / ``loss_knobs`` key must be a hyperparameter of the policy loss."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # as settings

    advantage: str = "gae"  # GAME_ADVANTAGES
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. V-trace's rho_bar
    policy_loss: str  # POLICY_LOSSES
    loss_kwargs: dict[str, Any] = Field(default_factory=dict)  # fixed hyperparameters
    # hyperparameter -> the LearnerSettings field that sets it, e.g. {"clip_low": "clip_coef"}
    loss_knobs: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_names(self) -> GamePreset:
        GAME_ADVANTAGES.get(self.advantage, field="advantage")
        GAME_ADVANTAGES.check_kwargs(
            self.advantage, self.advantage_kwargs, field="advantage_kwargs"
        )
        POLICY_LOSSES.get(self.policy_loss, field="policy_loss")
        POLICY_LOSSES.check_kwargs(self.policy_loss, self.loss_kwargs, field="loss_kwargs")
        POLICY_LOSSES.check_kwargs(self.policy_loss, self.loss_knobs, field="loss_knobs")
        both = sorted(set(self.loss_kwargs) & set(self.loss_knobs))
        if both:
            raise ValueError(f"loss_kwargs and loss_knobs both set {', '.join(both)}")
        return self

    def policy_loss_kwargs(self, knobs: object) -> dict[str, Any]:
        """The policy loss's keyword arguments: ``loss_kwargs``, plus each ``loss_knobs``
        hyperparameter set to that attribute of ``knobs`` (the ``LearnerSettings``)."""
        from_knobs = {hp: getattr(knobs, knob) for hp, knob in self.loss_knobs.items()}
        return {**self.loss_kwargs, **from_knobs}


def resolve_game_preset(name: str) -> GamePreset:
    """The game preset ``name``, validated (``UnknownNameError`` lists the known ones)."""
    return GamePreset.model_validate(GAME_PRESETS.get(name).model_dump())


def builtin_game_preset(name: str) -> GamePreset | None:
    """The built-in game preset ``name`` as registered, without importing the algorithm
    functions (torch): what ``rlfleet up`` and ``rlfleet validate`` check ``algo`` with. None
    when ``name`` is not built in, or when ``rlfleet.algos`` plugins are installed (a broken one
    must fail validation): then ``resolve_game_preset``. Not validated against the function
    registries here; tests resolve every built-in preset."""
    return None if plugins_installed() else GAME_PRESETS.registered(name)


def builtin_preset(name: str) -> Preset | None:
    """The built-in LM preset ``name`` as registered, without torch; as ``builtin_game_preset``
    (overrides need ``resolve_preset``, which checks them against the functions' parameters)."""
    return None if plugins_installed() else PRESETS.registered(name)


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
    for name_field, kwargs_field, _ in _COMPONENTS:
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


def _add_game(name: str, **fields: Any) -> None:
    GAME_PRESETS.add(name, GamePreset.model_construct(**fields))  # as _add; resolve validates


# CleanRL's ppo.py (Schulman et al. 2017, arXiv:1707.06347): symmetric clip at the clip_coef knob.
_add_game("ppo", advantage="gae", policy_loss="ppo", loss_knobs={"clip_low": "clip_coef"})
# A2C (Mnih et al. 2016, arXiv:1602.01783): the plain policy gradient, GAE advantages.
_add_game("a2c", advantage="gae", policy_loss="a2c")
# APPO (Sample Factory, Petrenko et al. 2020, arXiv:2006.11751; RLlib's APPO): the PPO clipped
# surrogate (ratio against the actor's log-probs) on V-trace advantages, V-trace value targets;
# rho_bar = c_bar = 1 as IMPALA (Espeholt et al. 2018, arXiv:1802.01561, section 5).
_add_game(
    "appo",
    advantage="vtrace",
    advantage_kwargs={"rho_bar": 1.0, "c_bar": 1.0},
    policy_loss="ppo",
    loss_knobs={"clip_low": "clip_coef"},
)


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

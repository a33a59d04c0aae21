"""Algorithm presets: every preset resolves, names exist in their registries, hyperparameters are
accepted by the functions they belong to, and overrides are validated."""

import pydantic
import pytest
import torch

from learner.algos import (
    AGGREGATIONS,
    GROUP_ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    SCHEDULES,
    Preset,
    UnknownNameError,
    WrongFamilyError,
    aggregate,
    resolve_preset,
)
from learner.lm.settings import LMLearnerSettings

EXPECTED = {
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "sapo",
    "cispo",
    "rloo",
    "reinforce_pp",
    "chord",
}


def test_all_presets_are_registered():
    assert set(PRESETS.names()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_resolves_and_its_names_exist(name):
    p = resolve_preset(name)
    assert isinstance(p, Preset)
    assert p.advantage in GROUP_ADVANTAGES
    assert p.policy_loss in POLICY_LOSSES
    assert p.aggregation in AGGREGATIONS
    assert p.kl_estimator in KL_ESTIMATORS
    assert p.chord_schedule in SCHEDULES


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_runs_end_to_end_on_a_tiny_batch(name):
    p = resolve_preset(name)
    torch.manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True] * 3])
    token_rewards = {"token_rewards": -p.kl_beta * torch.rand(4, 3)} if p.kl_in_reward else {}
    adv, _ = GROUP_ADVANTAGES.get(p.advantage)(
        rewards, groups, mask, **p.advantage_kwargs, **token_rewards
    )
    old = -torch.rand(4, 3)
    logp = (old + 0.01 * torch.randn(4, 3)).requires_grad_()
    loss, metrics = POLICY_LOSSES.get(p.policy_loss)(logp, old, adv, mask, **p.loss_kwargs)
    total = aggregate(loss, mask, p.aggregation, **p.aggregation_kwargs)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert {"approx_kl", "clipfrac"} <= set(metrics)


def test_preset_values():
    grpo = resolve_preset("grpo")
    assert (grpo.kl_beta, grpo.kl_estimator, grpo.aggregation) == (
        0.04,
        "k3",
        "seq-mean-token-mean",
    )
    assert grpo.loss_kwargs == {"clip_low": 0.2} and grpo.advantage_kwargs == {"norm_std": True}
    dapo = resolve_preset("dapo")
    assert dapo.loss_kwargs == {"clip_low": 0.2, "clip_high": 0.28}
    assert (dapo.aggregation, dapo.kl_beta) == ("token-mean", 0.0)
    assert dapo.dynamic_sampling and dapo.overlong_filter
    dr = resolve_preset("dr_grpo")
    assert dr.advantage_kwargs == {"norm_std": False}
    assert (dr.aggregation, dr.kl_beta) == ("seq-mean-token-sum-norm", 0.0)
    assert resolve_preset("gspo").loss_kwargs == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert resolve_preset("sapo").loss_kwargs == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert resolve_preset("reinforce_pp").kl_in_reward
    chord = resolve_preset("chord")
    assert chord.chord and chord.chord_mu(0) == pytest.approx(0.9)
    assert chord.chord_mu(200) == pytest.approx(0.05)


def test_unknown_override_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match="'kl_coef'") as info:
        resolve_preset("grpo", kl_coef=0.1)
    assert "kl_beta" in str(info.value) and "tis_cap" in str(info.value)


def test_overrides_replace_fields_and_merge_kwargs():
    p = resolve_preset("dapo", loss_kwargs={"clip_high": 0.3}, tis_cap=2.0, kl_beta=0.001)
    assert p.loss_kwargs == {"clip_low": 0.2, "clip_high": 0.3}
    assert (p.tis_cap, p.kl_beta) == (2.0, 0.001)
    assert resolve_preset("dapo").loss_kwargs["clip_high"] == 0.28  # registry entry untouched
    # switching the loss drops the old loss's kwargs
    assert resolve_preset("grpo", policy_loss="cispo").loss_kwargs == {}
    p = resolve_preset("dr_grpo", aggregation_kwargs={"loss_scale_factor": 4096})
    assert p.aggregation_kwargs == {"loss_scale_factor": 4096.0}


def test_invalid_overrides_are_rejected():
    with pytest.raises(ValueError, match="'tau'"):
        resolve_preset("grpo", loss_kwargs={"tau": 1.0})
    with pytest.raises(UnknownNameError, match="ppo2"):
        resolve_preset("grpo", policy_loss="ppo2")
    with pytest.raises(UnknownNameError, match="k9"):
        resolve_preset("grpo", kl_estimator="k9")
    with pytest.raises(ValueError, match="token_rewards"):
        resolve_preset("grpo", kl_in_reward=True)
    with pytest.raises(pydantic.ValidationError):
        resolve_preset("grpo", kl_beta=-1.0)
    with pytest.raises(UnknownNameError, match="nope"):
        resolve_preset("nope")


def test_presets_are_frozen():
    with pytest.raises(pydantic.ValidationError):
        resolve_preset("grpo").kl_beta = 0.0


@pytest.mark.parametrize(
    ("field", "name", "family"),
    [
        ("advantage", "gae", "a game advantage estimator"),
        ("policy_loss", "grpo", "a group advantage estimator and an LM algorithm preset"),
        ("aggregation", "ppo", "a policy loss and a game algorithm preset"),
        ("kl_estimator", "warmup_cosine", "a schedule"),
        ("chord_schedule", "k3", "a KL estimator"),
    ],
)
def test_a_name_of_the_wrong_family_fails_at_validation_naming_the_field(field, name, family):
    with pytest.raises(WrongFamilyError, match=rf"^{field}: '{name}' is {family}, not a"):
        resolve_preset("grpo", **{field: name})


def test_lm_settings_reject_a_wrong_family_override_at_the_algo_field():
    with pytest.raises(pydantic.ValidationError) as info:
        LMLearnerSettings(model_path="m", preset="grpo", algo={"advantage": "gae"})
    (error,) = info.value.errors()
    assert error["loc"] == ("algo",)
    assert "advantage: 'gae' is a game advantage estimator, not a group advantage" in error["msg"]
    with pytest.raises(pydantic.ValidationError, match="did you mean 'grpo'"):
        LMLearnerSettings(model_path="m", preset="grpoo")
    with pytest.raises(pydantic.ValidationError, match="'ppo' is a policy loss and a game"):
        LMLearnerSettings(model_path="m", preset="ppo")
    assert LMLearnerSettings(model_path="m", preset="dapo").algo == {}


def test_kwargs_errors_name_the_field_and_a_close_hyperparameter():
    expected = r"loss_kwargs: policy loss 'ppo' has no hyperparameter 'clip_hgh'; valid: clip_low, "
    with pytest.raises(ValueError, match=expected + r"clip_high, clip_ratio_c; did you mean"):
        resolve_preset("grpo", loss_kwargs={"clip_hgh": 0.3})
    with pytest.raises(ValueError, match="advantage_kwargs: group advantage estimator 'rloo'"):
        resolve_preset("rloo", advantage_kwargs={"norm_std": True})

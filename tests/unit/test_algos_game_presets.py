"""Game-RL presets: ``LearnerSettings.algo`` names a ``GAME_PRESETS`` entry whose names are checked
against their families and whose policy-loss hyperparameters come from the settings' knobs."""

import pydantic
import pytest

from learner.algos import (
    GAME_ADVANTAGES,
    GAME_PRESETS,
    POLICY_LOSSES,
    GamePreset,
    UnknownNameError,
    WrongFamilyError,
    a2c,
    gae,
    ppo_clip,
    resolve_game_preset,
)
from learner.game.settings import LearnerSettings


@pytest.mark.parametrize("name", ["ppo", "a2c"])
def test_builtin_game_presets_resolve(name):
    p = resolve_game_preset(name)
    assert GAME_ADVANTAGES.get(p.advantage) is gae
    assert POLICY_LOSSES.get(p.policy_loss) is {"ppo": ppo_clip, "a2c": a2c}[name]
    assert p == GAME_PRESETS.get(name)


def test_loss_kwargs_come_from_the_knobs_as_before():
    # was: {"clip_low": cfg.clip_coef} if cfg.algo == "ppo" else {}
    assert LearnerSettings().policy_loss_kwargs() == {"clip_low": 0.2}
    assert LearnerSettings(clip_coef=0.1).policy_loss_kwargs() == {"clip_low": 0.1}
    assert LearnerSettings(algo="a2c", clip_coef=0.1).policy_loss_kwargs() == {}
    assert LearnerSettings(algo="a2c").game_preset.policy_loss == "a2c"
    fixed = GamePreset(
        policy_loss="ppo", loss_kwargs={"clip_high": 0.3}, loss_knobs={"clip_low": "clip_coef"}
    )
    assert fixed.policy_loss_kwargs(LearnerSettings()) == {"clip_high": 0.3, "clip_low": 0.2}


def test_game_preset_names_of_the_wrong_family_fail_naming_the_field():
    with pytest.raises(WrongFamilyError, match=r"^advantage: 'grpo' is a group advantage estimator"
                       r".*, not a game advantage estimator; known .*: gae, vtrace$"):  # fmt: skip
        GamePreset(advantage="grpo", policy_loss="ppo")
    with pytest.raises(
        WrongFamilyError, match=r"^policy_loss: 'gae' is a game advantage estimator"
    ):
        GamePreset(policy_loss="gae")
    with pytest.raises(UnknownNameError, match=r"policy_loss: unknown policy loss 'ppo2'.*'ppo'"):
        GamePreset(policy_loss="ppo2")
    with pytest.raises(pydantic.ValidationError, match="loss_knobs: policy loss 'a2c' has no "
                       "hyperparameter 'clip_low'; valid: none"):  # fmt: skip
        GamePreset(policy_loss="a2c", loss_knobs={"clip_low": "clip_coef"})
    with pytest.raises(pydantic.ValidationError, match="both set clip_low"):
        GamePreset(policy_loss="ppo", loss_kwargs={"clip_low": 0.1}, loss_knobs={"clip_low": "x"})


def test_learner_settings_validate_algo_against_the_game_presets():
    with pytest.raises(pydantic.ValidationError) as info:
        LearnerSettings(algo="grpo")
    (error,) = info.value.errors()
    assert error["loc"] == ("algo",)
    assert (
        "'grpo' is a group advantage estimator and an LM algorithm preset, not a game"
        in (error["msg"])
    )
    with pytest.raises(pydantic.ValidationError, match="unknown game algorithm preset 'ppx'; "
                       "known: a2c, appo, ppo; did you mean 'ppo'"):  # fmt: skip
        LearnerSettings(algo="ppx")


def test_a_game_preset_reading_a_knob_that_does_not_exist_fails_at_validation(monkeypatch):
    monkeypatch.setattr(GAME_PRESETS, "_items", dict(GAME_PRESETS._items))
    GAME_PRESETS.add("ppo_typo", GamePreset(policy_loss="ppo", loss_knobs={"clip_low": "clip_cof"}))
    with pytest.raises(pydantic.ValidationError, match="loss_knobs from clip_cof, which are not"):
        LearnerSettings(algo="ppo_typo")

"""One declaration per knob: a job and the learner settings it expands into agree on every knob
they share (type, default, bounds, help), except the differences declared here on purpose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from learner.game.jobs import GameJobSettings
from learner.game.settings import GameTrainingKnobs, LearnerSettings
from learner.lm.dpo_job import DPOSettings
from learner.lm.jobs import LM_JOBS
from learner.lm.settings import LMLearnerSettings, LMTrainingKnobs
from services.registry import JOBS_GROUP, entry_point_registry, get_job

REQUIRED = "(required)"
# Knobs of a job that share a name with a learner setting but are the job's own (another type
# or meaning): the job derives the learner's value from them.
OWN = {
    "game": {"env_servers", "fragments_per_update"},
    # preset: a Literal of the job's kind; env: the drivers' text env, which the learner gets
    # with its env server added
    "lm": {"preset", "env"},
    "dpo": set(),
}
GAME_DEFAULTS = {"env_id": (REQUIRED, "CartPole-v1"), "minibatch_size": (256, 128)}
# (job default, learner default) where a job states its own default over the learner's.
DEFAULTS: dict[str, dict[str, tuple[Any, Any]]] = {
    "ppo": GAME_DEFAULTS,
    "a2c": {**GAME_DEFAULTS, "algo": ("a2c", "ppo"), "update_epochs": (1, 4)},
    "appo": {**GAME_DEFAULTS, "algo": ("appo", "ppo")},
    **{kind: {"model_path": (Path("runs/models/tiny-arith"), REQUIRED)} for kind in LM_JOBS},
    "dpo": {},
}


def _learner_settings(kind: str) -> tuple[str, type[BaseModel]]:
    if kind in ("ppo", "a2c", "appo"):
        return "game", LearnerSettings
    if kind in LM_JOBS:
        return "lm", LMLearnerSettings
    assert kind == "dpo", f"a new learner job kind {kind!r}: add it to this test"
    return "dpo", DPOSettings


def _default(info: FieldInfo) -> Any:
    return REQUIRED if info.is_required() else info.get_default(call_default_factory=True)


def _shape(info: FieldInfo) -> tuple[Any, ...]:
    return info.annotation, info.metadata, info.description


LEARNER_JOBS = [kind for kind in entry_point_registry(JOBS_GROUP) if kind != "serve"]


def test_every_learner_job_kind_is_covered() -> None:
    assert set(LEARNER_JOBS) == set(DEFAULTS)


@pytest.mark.parametrize("kind", LEARNER_JOBS)
def test_a_job_and_its_learner_declare_each_shared_knob_alike(kind: str) -> None:
    family, learner = _learner_settings(kind)
    job = get_job(kind).settings
    own = OWN[family]
    if kind == "appo":  # V-trace corrects lagged fragments: its own bound and help
        own = own | {"max_policy_lag"}
    shared = (set(job.model_fields) & set(learner.model_fields)) - own
    assert shared, kind
    for name in sorted(shared):
        ours, theirs = job.model_fields[name], learner.model_fields[name]
        assert _shape(ours) == _shape(theirs), f"{kind}: {name} is declared twice"
        assert ours.description, f"{kind}: {name} has no help"
        want = DEFAULTS[kind].get(name)
        got = (_default(ours), _default(theirs))
        if want is None:
            assert got[0] == got[1], f"{kind}: {name} defaults differ {got}, not declared here"
        else:
            assert got == want, f"{kind}: {name}"
    assert set(DEFAULTS[kind]) <= shared, "a declared difference that is gone: drop it here"


def test_learner_ranks_is_the_learners_ranks_knob() -> None:
    job, learner = (
        GameJobSettings.model_fields["learner_ranks"],
        LearnerSettings.model_fields["ranks"],
    )
    assert (*_shape(job), _default(job)) == (*_shape(learner), _default(learner))


@pytest.mark.parametrize(
    ("kind", "knobs", "base"),
    [("ppo", {"env_id": "CartPole-v1"}, GameTrainingKnobs), ("grpo", {}, LMTrainingKnobs)],
)
def test_expand_passes_every_shared_knob_on_by_name(
    kind: str, knobs: dict[str, Any], base: type[BaseModel]
) -> None:
    spec = get_job(kind)
    job = spec.settings.model_validate(knobs)
    learner = next(e for e in spec.expand(job, "r") if e["name"] == "learner")["settings"]
    for name in base.model_fields:
        assert learner[name] == job.model_dump()[name], name


def test_a_job_with_no_overrides_keeps_its_defaults_and_a_hand_written_learner_its_own() -> None:
    job = get_job("ppo").settings.model_validate({"env_id": "CartPole-v1"})
    learner = next(e for e in get_job("ppo").expand(job, "r") if e["name"] == "learner")
    settings = LearnerSettings.model_validate(learner["settings"])
    assert (settings.minibatch_size, settings.fragments_per_update) == (256, job.num_actors)
    hand_written = LearnerSettings()
    assert (hand_written.env_id, hand_written.minibatch_size) == ("CartPole-v1", 128)
    assert hand_written.fragments_per_update == 4


@pytest.mark.parametrize(
    ("job_knob", "model", "name"),
    [
        ("sft_steps", "SFTSettings", "steps"),
        ("sft_batch_size", "SFTSettings", "batch_size"),
        ("sft_learning_rate", "SFTSettings", "learning_rate"),
        ("eval_every", "EvalSettings", "every"),
        ("eval_split", "EvalSettings", "split"),
    ],
)
def test_lm_jobs_flat_sft_and_eval_knobs_are_the_learners(
    job_knob: str, model: str, name: str
) -> None:
    import learner.lm.settings

    theirs = getattr(learner.lm.settings, model).model_fields[name]
    for spec in LM_JOBS.values():
        ours = spec.settings.model_fields[job_knob]
        assert (*_shape(ours), _default(ours)) == (*_shape(theirs), _default(theirs))

"""`job:` run files: flat PPO knobs expand into services, bad knobs fail at load naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import load_run_config
from services.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return path


def test_cartpole_example_expands_into_servers_learner_and_actors() -> None:
    config = load_run_config(ROOT / "examples" / "cartpole_ppo.yaml", environ={})
    kinds = [(e.name, e.service, e.main) for e in config.services]
    assert kinds == [
        ("env-0", "env_server", False),
        ("learner", "learner", True),
        ("actor-0", "game_actor", False),
        ("actor-1", "game_actor", False),
    ]
    learner = config.service("learner").settings
    assert learner.fragments_per_update == 2 and learner.target_return == 475
    actors = [config.service(f"actor-{i}").settings for i in range(2)]
    assert [a.actor_index for a in actors] == [0, 1]
    assert {a.env_seed() for a in actors} == {1, 5}  # distinct env seeds per actor
    assert all(a.fragments_per_version == 1 and a.policy == "learner" for a in actors)
    assert learner.policy == actors[0].policy_config


def test_external_env_servers_are_not_started(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "run: {name: r}\njob:\n  kind: a2c\n  env_id: CartPole-v1\n"
        "  env_servers: ['10.0.0.5:50051', 'envs:50051']\n  num_envs: 2\n  minibatch_size: 64\n",
    )
    config = load_run_config(path, environ={})
    assert [e.service for e in config.services] == ["learner", "game_actor"]
    assert config.service("learner").settings.algo == "a2c"
    assert config.service("actor-0").settings.env_servers == ["10.0.0.5:50051", "envs:50051"]


@pytest.mark.parametrize(
    ("knob", "line", "message"),
    [
        ("num_envs: -4", 5, "job.num_envs: Input should be greater than or equal to 1"),
        ("kind: ppx", 3, "unknown job kind 'ppx'"),
        ("env_id: CartPol-v1", 4, "no env server hosts env id 'CartPol-v1'"),
        ("minibatch_size: 100000", 3, "minibatch_size=100000 exceeds the batch"),
        ("learning_rat: 0.1", 5, "job.learning_rat: unknown key 'learning_rat'"),
    ],
)
def test_bad_knobs_fail_at_load_naming_key_and_line(
    tmp_path: Path, knob: str, line: int, message: str
) -> None:
    lines = ["run: {name: r}", "job:", "  kind: ppo", "  env_id: CartPole-v1", "  num_envs: 4"]
    key = knob.split(":")[0]
    lines = [ln for ln in lines if not ln.strip().startswith(f"{key}:")]
    lines.insert(line - 1, f"  {knob}")
    path = _write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    assert message in str(err.value)
    assert f"run.yaml:{line}:" in str(err.value) or "minibatch" in knob


def test_game_job_algo_is_checked_against_the_game_presets(tmp_path: Path) -> None:
    body = "run: {name: r}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n  algo: grpo\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert "run.yaml:5: job.algo: 'grpo' is a group advantage estimator" in str(err.value)
    assert "not a game algorithm preset; known game algorithm preset names: a2c, ppo" in str(
        err.value
    )


def test_lm_job_override_of_the_wrong_family_fails_at_its_line(tmp_path: Path) -> None:
    body = (
        "run: {name: r}\njob:\n  kind: grpo\n  model_path: m\n  algo:\n    kl_beta: 0.0\n"
        "    advantage: gae\n"
    )
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    message = str(err.value)
    assert "job.algo: advantage: 'gae' is a game advantage estimator, not a group advantage" in (
        message
    )


@pytest.mark.parametrize(
    ("kind", "algo", "expert"),
    [("chord", {}, True), ("grpo", {}, False), ("grpo", {"chord": True}, True)],
)
def test_rollout_drivers_send_expert_completions_when_the_preset_mixes_sft(
    kind: str, algo: dict[str, object], expert: bool
) -> None:
    from learner.lm.jobs import LM_JOBS, expand

    settings = LM_JOBS[kind].settings.model_validate({"model_path": "m", "algo": algo})
    (driver,) = [e for e in expand(settings, "r") if e["service"] == "rollout"]
    assert driver["settings"]["expert_completions"] is expert


def test_every_lm_job_kind_is_a_preset() -> None:
    from learner.algos import PRESETS
    from learner.lm.jobs import PRESET_NAMES

    assert set(PRESET_NAMES) <= set(PRESETS.names())

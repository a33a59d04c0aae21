"""`job:` run files: flat PPO knobs expand into services, bad knobs fail at load naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from services.config import load_run_config
from services.errors import ConfigError
from tests.fixtures.launch import two_actor_cartpole

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return path


def test_cartpole_example_expands_into_servers_learner_and_actors(tmp_path: Path) -> None:
    config = load_run_config(ROOT / "examples" / "cartpole_ppo.yaml", environ={})
    kinds = [(e.name, e.service, e.main) for e in config.services]
    assert kinds == [
        ("env-0", "env_server", False),
        ("learner", "learner", True),
        ("actor-0", "game_actor", False),
    ]
    learner = config.service("learner").settings
    assert learner.fragments_per_update == 1 and learner.target_return == 475
    # Two actors (the shape the multi-actor tests run): one fragment of each per update.
    two = yaml.safe_dump(two_actor_cartpole(), sort_keys=False)
    config = load_run_config(_write(tmp_path, two), environ={})
    assert [e.name for e in config.services] == ["env-0", "learner", "actor-0", "actor-1"]
    learner = config.service("learner").settings
    assert learner.fragments_per_update == 2
    actors = [config.service(f"actor-{i}").settings for i in range(2)]
    assert [a.actor_index for a in actors] == [0, 1]
    assert {a.env_seed() for a in actors} == {1, 5}  # distinct env seeds per actor
    assert all(a.fragments_per_version == 1 and a.policy == "learner" for a in actors)
    assert learner.policy == actors[0].policy_config


@pytest.mark.parametrize(
    ("knobs", "usable", "placed"),
    [
        ("", {0, 1, 2, 3}, True),  # auto: the learner on the last CPU, the rest on the others
        ("  cpu_placement: off\n  double_buffer: off\n", {0, 1, 2, 3}, False),  # YAML's off
        ("", {0}, False),  # nothing to split
        ("  learner_ranks: 2\n", {0, 1, 2, 3}, False),  # its ranks need CPUs of their own
    ],
)
@pytest.mark.usefixtures("one_thread")
def test_game_jobs_give_the_learner_a_cpu_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, knobs: str, usable: set[int], placed: bool
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: usable)
    body = (
        (ROOT / "examples" / "cartpole_ppo.yaml").read_text().replace("job:\n", "job:\n" + knobs, 1)
    )
    config = load_run_config(_write(tmp_path, body), environ={})
    cpus = {e.name: e.cpus for e in config.services}
    if placed:
        assert cpus == {"env-0": [0, 1, 2], "learner": [3], "actor-0": [0, 1, 2]}
    else:
        assert set(cpus.values()) == {None}


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_a_learner_computing_with_more_threads_gets_as_many_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    body = (ROOT / "examples" / "cartpole_ppo.yaml").read_text()
    cpus = {}
    for threads in ("2", "4"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        config = load_run_config(_write(tmp_path, body), environ={})
        cpus[threads] = (config.service("learner").cpus, config.service("actor-0").cpus)
    assert cpus == {"2": ([2, 3], [0, 1]), "4": (None, None)}  # 4: none left for the others


@pytest.mark.parametrize("placement", ["auto", "off"])
@pytest.mark.usefixtures("one_thread")
def test_lm_jobs_give_the_learner_a_cpu_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    body = (ROOT / "examples" / "grpo_arith.yaml").read_text()
    body = body.replace("job:\n", f"job:\n  cpu_placement: {placement}\n", 1)
    one_thread = body.replace("learner_threads: 2", "learner_threads: 1", 1)
    config = load_run_config(_write(tmp_path, one_thread), environ={})
    cpus = {e.name: e.cpus for e in config.services}
    if placement == "auto":
        assert cpus == {"reward": [0], "learner": [1], "sampler-0": [0], "rollout-0": [0]}
    else:
        assert set(cpus.values()) == {None}
    # The example's learner computes on 2 threads: on 2 CPUs none is left for the others (not
    # placed); on 4 it gets the last 2.
    config = load_run_config(_write(tmp_path, body), environ={})
    assert config.service("learner").threads == 2
    assert config.service("learner").cpus is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    config = load_run_config(_write(tmp_path, body), environ={})
    cpus = {e.name: e.cpus for e in config.services}
    if placement == "auto":
        assert cpus == {"reward": [0, 1], "learner": [2, 3], "sampler-0": [0, 1],
                        "rollout-0": [0, 1]}  # fmt: skip
    else:
        assert set(cpus.values()) == {None}


@pytest.mark.parametrize(
    ("cpus", "message"), [("[0, 0]", "CPU ids repeated"), ("[-1]", "greater than or equal")]
)
def test_bad_service_cpus_fail_at_load(tmp_path: Path, cpus: str, message: str) -> None:
    body = f"run: {{name: r}}\nservices:\n  - {{name: hb, service: heartbeat, cpus: {cpus}}}\n"
    with pytest.raises(ConfigError, match=message):
        load_run_config(_write(tmp_path, body), environ={})


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
    assert "not a game algorithm preset; known game algorithm preset names: a2c, appo, ppo" in str(
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


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            "  num_actors: 100000\n",
            "run.yaml:5: job.num_actors: Input should be less than or equal",
        ),
        ("  num_envs: 100000\n", "run.yaml:5: job.num_envs: Input should be less than or equal"),
        ("  env_servers: 5000\n  num_envs: 5000\n", "env_servers=5000 is more than the 256"),
        (
            "  num_actors: 1000\n  num_envs: 1000\n",
            "num_actors x num_envs = 1000 x 1000 = 1000000 envs, more than the 65536 allowed",
        ),
    ],
)
def test_counts_have_upper_bounds(tmp_path: Path, knobs: str, message: str) -> None:
    body = "run: {name: r}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n" + knobs
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert message in str(err.value)


def test_largest_allowed_counts_still_validate() -> None:
    from learner.game.jobs import MAX_ACTORS, GameJobSettings

    settings = GameJobSettings(env_id="CartPole-v1", num_actors=MAX_ACTORS, num_envs=64)
    assert settings.num_actors == MAX_ACTORS


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import learner.settings

    monkeypatch.delenv(learner.settings.SKIP_DEVICE_CHECK_ENV, raising=False)
    monkeypatch.setattr(learner.settings, "_cuda_available", lambda: False)


@pytest.mark.usefixtures("no_cuda")
def test_cuda_device_without_cuda_fails_validation(tmp_path: Path) -> None:
    body = "run: {name: r}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n  device: cuda\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert "run.yaml:5: job.device: device 'cuda' but this host has no usable CUDA" in str(
        err.value
    )
    # The learner's own settings check it too (a hand-written learner entry, no job).
    from learner.game.settings import LearnerSettings
    from learner.settings import DeepSpeedSettings

    with pytest.raises(ValueError, match="no usable CUDA device"):
        LearnerSettings(device="cuda")
    with pytest.raises(ValueError, match="no usable CUDA device"):
        DeepSpeedSettings(device="cuda")


@pytest.mark.usefixtures("no_cuda")
def test_auto_and_cpu_devices_need_no_cuda_and_the_check_can_be_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.game.settings import LearnerSettings
    from learner.settings import SKIP_DEVICE_CHECK_ENV

    for device in ("auto", "cpu"):
        body = f"run: {{name: r}}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n  device: {device}\n"
        config = load_run_config(_write(tmp_path, body), environ={})
        assert config.service("learner").settings.device == device
    monkeypatch.setenv(SKIP_DEVICE_CHECK_ENV, "1")  # validating for another (GPU) host
    assert LearnerSettings(device="cuda").device == "cuda"


def test_cuda_device_validates_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    import learner.game.settings
    import learner.settings

    monkeypatch.setattr(learner.settings, "_cuda_available", lambda: True)
    assert learner.game.settings.LearnerSettings(device="cuda").device == "cuda"


# --- rewards and envs named by reference (module:name, path/to/file.py:name) -----------------

BREVITY = "examples/custom_reward.py:brevity"
CORRIDOR = "examples/custom_env.py:Corridor"


@pytest.mark.parametrize("example", ["grpo_custom_reward.yaml", "ppo_custom_env.yaml"])
def test_the_custom_reward_and_env_examples_validate(
    example: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main

    monkeypatch.chdir(ROOT)  # the examples' file references are relative to the current directory
    assert main(["validate", f"examples/{example}"]) == 0
    assert capsys.readouterr().out.startswith(f"OK: examples/{example}")


def test_a_reward_reference_reaches_the_reward_service_and_the_drivers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    config = load_run_config("examples/grpo_custom_reward.yaml", environ={})
    assert config.service("reward").settings.plugins == [BREVITY]  # registered at its start
    driver = config.service("rollout-0").settings
    assert [(r.name, r.kwargs) for r in driver.rewards] == [
        ("accuracy", {}),
        (BREVITY, {"max_chars": 16}),
    ]


def test_an_env_reference_is_preloaded_by_the_env_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    config = load_run_config("examples/ppo_custom_env.yaml", environ={})
    assert config.service("env-0").settings.preload == [CORRIDOR]
    assert config.service("actor-0").settings.env_id == CORRIDOR


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            "{name: 'examples/custom_reward.py:brevty'}",
            "run.yaml:7: job.rewards[1].name: 'examples/custom_reward.py:brevty' — module "
            "custom_reward has no attribute 'brevty' (did you mean 'brevity'?)",
        ),
        (
            "{name: 'tests.plugins.reference_rewards:scaled', kwargs: {scael: 2}}",
            "run.yaml:7: job.rewards[1].kwargs: 'tests.plugins.reference_rewards:scaled' — "
            "takes no keyword 'scael' (takes: scale)",
        ),
        (
            "{name: 'tests.plugins.reference_rewards:needs_level'}",
            "run.yaml:5: job.rewards: rewards[1]: 'tests.plugins.reference_rewards:needs_level' "
            "— parameter 'level' has no default and nothing passes it: set it in kwargs, or give "
            "the dataset a 'level' column (its columns: answer, solution)",
        ),
        (
            "{name: 'no/such/file.py:f'}",
            "run.yaml:7: job.rewards[1].name: 'no/such/file.py:f' — file ",
        ),
    ],
)
def test_a_bad_reward_reference_fails_at_load_naming_key_and_line(
    reward: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    body = (
        "run: {name: r}\njob:\n  kind: grpo\n  model_path: m\n  rewards:\n"
        f"  - {{name: accuracy}}\n  - {reward}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert message in str(err.value)


def test_a_bad_env_reference_fails_at_load_naming_key_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    body = "run: {name: r}\njob:\n  kind: ppo\n  env_id: examples/custom_env.py:Coridor\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert (
        "run.yaml:4: job.env_id: 'examples/custom_env.py:Coridor' — module custom_env has no "
        "attribute 'Coridor' and registers no gymnasium id 'Coridor' (did you mean 'Corridor'?)"
    ) in str(err.value)


@pytest.mark.parametrize(
    ("knob", "message"),
    [
        (
            "env_name: CartPole-v1",
            "job.env_name: unknown key 'env_name' (rlfleet calls it 'env_id')",
        ),
        ("n_envs: 4", "job.n_envs: unknown key 'n_envs' (rlfleet calls it 'num_envs')"),
        ("num_workers: 4", "job.num_workers: unknown key 'num_workers': use num_actors"),
        ("n_timesteps: 10", "job.n_timesteps: unknown key 'n_timesteps' (rlfleet calls it "),
        ("lr: 0.1", "job.lr: unknown key 'lr' (rlfleet calls it 'learning_rate')"),
        ("ppo_epochs: 2", "job.ppo_epochs: unknown key 'ppo_epochs' (rlfleet calls it 'update_"),
        ("gpu_ids: [0]", "job.gpu_ids: unknown key 'gpu_ids' (rlfleet calls it 'device')"),
        ("batch_size: 64", "job.batch_size: unknown key 'batch_size': rlfleet's minibatch_size is"),
        ("beta: 0.1", "job.beta: unknown key 'beta': game jobs have no KL penalty"),
    ],
)
def test_game_job_aliases_point_at_the_rlfleet_knob(
    tmp_path: Path, knob: str, message: str
) -> None:
    body = f"run: {{name: r}}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n  {knob}\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert f"run.yaml:5: {message}" in str(err.value)
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize(
    ("knob", "line", "message"),
    [
        ("beta: 0.1", 5, "job.beta: unknown key 'beta': use algo: {kl_beta: ...} (TRL/ms-swift"),
        (
            "num_generations: 4",
            5,
            "job.num_generations: unknown key 'num_generations' (rlfleet calls it 'group_size')",
        ),
        ("batch_size: 8", 5, "the rollout batch per update is groups_per_update x group_size"),
        ("algo: {kl_bta: 0.1}", 5, "job.algo.kl_bta: unknown key 'kl_bta' (did you mean 'kl_beta'"),
    ],
)
def test_lm_job_aliases_and_nested_keys(tmp_path: Path, knob: str, line: int, message: str) -> None:
    body = f"run: {{name: r}}\njob:\n  kind: grpo\n  model_path: m\n  {knob}\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert f"run.yaml:{line}: job." in str(err.value) and message in str(err.value)


def test_nested_algo_key_names_its_own_line(tmp_path: Path) -> None:
    body = "run: {name: r}\njob:\n  kind: grpo\n  model_path: m\n  algo:\n    kl_beta: 0\n"
    body += "    beta: 1\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert str(err.value).endswith(
        "run.yaml:7: job.algo.beta: unknown key 'beta' (rlfleet calls it 'kl_beta')"
    )


def test_serve_job_alias(tmp_path: Path) -> None:
    body = "run: {name: r}\njob:\n  kind: serve\n  model: m\n  api_key: k\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert "run.yaml:5: job.api_key: unknown key 'api_key': use api_keys: [{key: ...}]" in str(
        err.value
    )


def test_aliases_point_at_real_knobs() -> None:
    from gateway.jobs import ServeJobSettings
    from learner.game.jobs import GameJobSettings
    from learner.lm.jobs import LMJobSettings, RewardKnob

    for model in (GameJobSettings, LMJobSettings, RewardKnob, ServeJobSettings):
        assert model.aliases
        for alias, hint in model.aliases.items():
            assert alias not in model.model_fields, alias  # an alias never shadows a knob
            assert hint in model.model_fields or " " in hint, (alias, hint)  # a knob or a line


def test_flat_job_without_job_section_says_so(tmp_path: Path) -> None:
    path = _write(tmp_path, "run: {name: r}\nkind: ppo\nenv_id: CartPole-v1\nnum_envs: 4\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    assert str(err.value) == (
        f"{path}:2: kind: this looks like a job's knobs at the top level (kind, env_id, "
        "num_envs); put them under `job:` (job: {kind: ppo, env_id: ...})"
    )


def test_flat_job_without_run_keeps_the_run_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "env_id: CartPole-v1\nkind: ppo\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    message = str(err.value)
    assert f"{path}:1: env_id: this looks like a job's knobs at the top level" in message
    assert "run: Field required" in message and "services" not in message


def test_job_knob_at_the_top_level_points_under_job(tmp_path: Path) -> None:
    body = "run: {name: r}\ndevice: cpu\nlr: 0.1\njob:\n  kind: ppo\n  env_id: CartPole-v1\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    message = str(err.value)
    assert "run.yaml:2: device: unknown key 'device': a job knob at the top level; put it " \
        "under `job:` (job.device)" in message  # fmt: skip
    assert "run.yaml:3: lr: unknown key 'lr': job knobs go under `job:`, and rlfleet calls it " \
        "job.learning_rate" in message  # fmt: skip
    assert "services" not in message


def test_a_trl_style_reward_gets_every_dataset_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TRL passes every dataset column as a keyword: a required parameter named after a column
    # (arith's solution, answer) needs no extra_keys, nor one named after a JSONL file's column.
    monkeypatch.chdir(ROOT)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Q: 1+1=?", "answer": "2", "level": 3}\n')
    refs = "tests.plugins.reference_rewards"
    for dataset, ref in [
        ("{generator: arith}", "trl_accuracy"),
        (f"{{jsonl: {rows}}}", "needs_level"),
    ]:
        body = (
            f"run: {{name: r}}\njob:\n  kind: grpo\n  model_path: m\n  dataset: {dataset}\n"
            f"  eval_count: 0\n  rewards:\n  - {{name: '{refs}:{ref}'}}\n"
        )
        config = load_run_config(_write(tmp_path, body), environ={})
        assert config.service("reward").settings.plugins == [f"{refs}:{ref}"]


def test_validate_print_shows_every_expanded_service_with_its_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["validate", "--print", "examples/cartpole_ppo.yaml"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["services"]
    config = load_run_config("examples/cartpole_ppo.yaml", environ={})
    assert [s["name"] for s in printed] == [entry.name for entry in config.services]
    learner = next(s for s in printed if s["name"] == "learner")
    assert learner["settings"] == config.service("learner").settings.model_dump(mode="json")


def test_an_agent_job_runs_the_training_gateway_and_the_programs_instead_of_drivers(
    tmp_path: Path,
) -> None:
    import sys

    body = (ROOT / "examples" / "agent_openai.yaml").read_text()
    config = load_run_config(_write(tmp_path, body), environ={})
    names = [e.name for e in config.services]
    assert names == ["reward", "learner", "sampler-0", "env-0", "gateway", "agent-0", "agent-1"]
    gateway = config.service("gateway").settings
    training = gateway.training
    assert training.group_size == 8 and training.groups_per_version == 4
    assert training.dataset["generator"] == "arith" and training.max_calls_per_session == 3
    port = gateway.http_port
    assert port > 0 and gateway.samplers == ["sampler-0"]
    runner = config.service("agent-1").settings
    assert runner.command == [sys.executable, "agent_openai.py"]  # the run's own Python
    assert runner.env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{port}/v1"
    assert runner.env["RLFLEET_AGENT_RUNNER"] == "agent-1"
    # The env serves the learner only: its demonstrations and evaluations.
    learner = config.service("learner").settings
    assert learner.env.env_id == "Calculator-v0" and learner.sft.steps == 300


def test_init_model_says_when_the_existing_model_was_made_for_another_env(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder init-model made for one env (or none), reused by a job on another, keeps a
    tokenizer that never saw the job's env text: the launcher says so rather than train on
    prompts several times longer."""
    from learner.lm.jobs import LM_JOBS

    spec = LM_JOBS["grpo"]
    assert spec.prepare is not None
    job = {"model_path": str(tiny_model_dir), "init_model": "tiny",
           "env": {"env_id": "GuessNumber-v0"}}  # fmt: skip
    spec.prepare(spec.settings.model_validate(job), tmp_path)
    said = capsys.readouterr().out
    assert f"{tiny_model_dir} was made for no env, not GuessNumber-v0" in said

    made_for_it = tmp_path / "guess-model"
    made_for_it.mkdir()
    shutil.copy(tiny_model_dir / "config.json", made_for_it)
    facts = json.loads((tiny_model_dir / "rlfleet_model.json").read_text())
    (made_for_it / "rlfleet_model.json").write_text(
        json.dumps({**facts, "tokenizer_env": "GuessNumber-v0"})
    )
    spec.prepare(spec.settings.model_validate({**job, "model_path": str(made_for_it)}), tmp_path)
    assert "warning" not in capsys.readouterr().out

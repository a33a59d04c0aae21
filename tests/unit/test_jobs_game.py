"""The PPO/A2C job's `game:` block: an external game instead of actors. It expands into env
servers hosting GameLink for the learner, one `process` service per game instance (told its env
server's address), and the learner; validated through the real settings models."""

from __future__ import annotations

from pathlib import Path

import pytest

from env_server.game_link.settings import GameLinkSettings
from launch.cli import main as rlfleet
from services.config import load_run_config
from services.errors import ConfigError
from services.process import ProcessSettings

GAME_JOB = """\
run: {name: snake-ts}
job:
  kind: ppo
  env_id: SnakeTS-v0
  env_servers: 2
  rollout_length: 64
  hidden_sizes: [32, 32]
  game:
    command: [sh, -c, 'exec sleep 1']
    cwd: game
    instances: 3
    env: {BOARDS: 8}
"""


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "game").mkdir(exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return path


def test_game_expands_into_game_link_servers_processes_and_the_learner(tmp_path: Path) -> None:
    config = load_run_config(_write(tmp_path, GAME_JOB), environ={})
    assert [(e.name, e.service, e.main) for e in config.services] == [
        ("env-0", "env_server", False),
        ("env-1", "env_server", False),
        ("game-0", "process", False),
        ("game-1", "process", False),
        ("game-2", "process", False),
        ("learner", "learner", True),
    ]
    learner = config.service("learner").settings
    for name in ("env-0", "env-1"):
        server = config.service(name).settings
        link = server.game_link
        assert isinstance(link, GameLinkSettings) and link.enabled and link.policy == "learner"
        assert link.learner == "learner" and link.rollout_length == 64
        assert link.policy_config == learner.policy  # the same network as the learner trains
        # Each game's link paced to its share of an update, as actors are: one update ahead.
        assert link.fragments_per_version == 1
        assert server.preload == []  # the env id is the game's, not one this server creates
    games = [config.service(f"game-{i}").settings for i in range(3)]
    assert all(isinstance(g, ProcessSettings) for g in games)
    assert [g.env["RLFLEET_GAME_LINK_ADDRESS"] for g in games] == [
        "{address:env-0}",
        "{address:env-1}",
        "{address:env-0}",
    ]
    assert games[0].env["RLFLEET_RUN"] == "{run}" and games[0].env["BOARDS"] == "8"
    assert games[0].command == ["sh", "-c", "exec sleep 1"] and games[0].cwd == "game"
    assert learner.env_id == "SnakeTS-v0" and learner.env_servers == ["env-0"]
    assert learner.fragments_per_update == 3  # one T x agents fragment per game link


def test_game_link_settings_given_for_the_env_servers_are_kept(tmp_path: Path) -> None:
    body = GAME_JOB + (
        "  env_server: {game_link: {resume_window_s: 5, fragments_per_version: 2},"
        " max_sessions: 4}\n"
    )
    config = load_run_config(_write(tmp_path, body), environ={})
    server = config.service("env-0").settings
    assert server.max_sessions == 4 and server.game_link.resume_window_s == 5
    assert server.game_link.fragments_per_version == 2
    assert server.game_link.enabled and server.game_link.learner == "learner"


@pytest.mark.parametrize(
    ("extra", "line", "message"),
    [
        ("  num_envs: 8\n", 13, "job.num_envs: num_envs does not apply with `game:`"),
        ("  num_actors: 2\n", 13, "job.num_actors: num_actors does not apply with `game:`"),
        ("  game: {command: []}\n", 8, "job.game.command: List should have at least 1 item"),
        ("  game: {command: [g], instances: 0}\n", 8, "job.game.instances: Input should be"),
    ],
)
def test_bad_game_knobs_fail_naming_key_and_line(
    tmp_path: Path, extra: str, line: int, message: str
) -> None:
    body = GAME_JOB
    if extra.startswith("  game:"):
        body = body.split("  game:")[0]
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body + extra), environ={})
    assert f"run.yaml:{line}: {message}" in str(err.value)


def test_game_needs_env_servers_the_run_starts(tmp_path: Path) -> None:
    body = GAME_JOB.replace("env_servers: 2", "env_servers: ['10.0.0.5:50051']")
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert "run.yaml:5: job.env_servers: with `game:` the run starts its env servers" in str(
        err.value
    )


def test_a_game_program_that_is_not_there_fails_validation(tmp_path: Path) -> None:
    body = GAME_JOB.replace("[sh, -c, 'exec sleep 1']", "[./snake-game]")
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={}, check_machine=True)
    assert "services[2].settings.command[0]: program './snake-game' not found" in str(err.value)


def test_without_game_the_env_id_is_still_checked(tmp_path: Path) -> None:
    body = "run: {name: r}\njob:\n  kind: ppo\n  env_id: Snak-v0\n"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, body), environ={})
    assert "run.yaml:4: job.env_id: no env server hosts env id 'Snak-v0'" in str(err.value)
    assert "did you mean Snake-v0" in str(err.value)


def test_rlfleet_jobs_shows_the_game_knob_with_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert rlfleet(["jobs", "ppo"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "an external game" in rows["game"] and "GameLink" in rows["game"]
    assert "instances" in rows and "spread over the env servers" in rows["instances"]
    assert "argv of the game" in rows["command"]

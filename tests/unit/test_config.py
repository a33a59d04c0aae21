"""Run config loading: every mistake is a ConfigError naming file:line and the key.

Uses the real `heartbeat` service kind (registered by this package's entry points), so the
per-service settings checks run against a real settings model through the real registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import Field

from services.builtin import HeartbeatSettings
from services.config import (
    RunConfig,
    ServiceRef,
    StrictModel,
    load_run_config,
    load_service_settings,
    settings_from_env,
    validate_run_config,
)
from services.errors import ConfigError

GOOD = """\
run:
  name: demo
services:
  - name: hb-a
    service: heartbeat
    settings:
      interval_s: 0.5
  - name: hb-main
    service: heartbeat
    main: true
    restarts: 0
    settings:
      exit_after_s: 2
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path, environ or {})
    return str(info.value)


def test_good_config_validates_settings_into_models(tmp_path: Path) -> None:
    config = load_run_config(write(tmp_path, GOOD), {})
    assert config.run.name == "demo"
    assert config.run_dir == Path("runs/demo")
    assert config.nats.url is None
    a, main = config.services
    assert isinstance(a.settings, HeartbeatSettings) and a.settings.interval_s == 0.5
    assert a.restarts == 3 and not a.main
    assert main.main and main.restarts == 0 and main.settings.exit_after_s == 2
    assert config.service("hb-main") is main


def test_unknown_key_names_line_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("  name: demo\n", "  name: demo\n  nmae: x\n"))
    assert error_of(path) == f"{path}:3: run.nmae: unknown key 'nmae' (did you mean 'name'?)"


def test_unknown_settings_key_names_line_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("interval_s: 0.5", "intervl_s: 0.5"))
    assert error_of(path) == (
        f"{path}:7: services[0].settings.intervl_s: unknown key 'intervl_s' "
        "(did you mean 'interval_s'?)"
    )


def test_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("interval_s: 0.5", "interval_s: fast"))
    message = error_of(path)
    assert message.startswith(f"{path}:7: services[0].settings.interval_s: Input should be")
    assert "number" in message


def test_negative_value(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("exit_after_s: 2", "exit_after_s: -2"))
    assert error_of(path) == (
        f"{path}:13: services[1].settings.exit_after_s: Input should be greater than 0"
    )
    path = write(tmp_path, GOOD.replace("restarts: 0", "restarts: -1"))
    assert error_of(path) == (
        f"{path}:11: services[1].restarts: Input should be greater than or equal to 0"
    )


def test_duplicate_service_names(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("name: hb-main", "name: hb-a"))
    assert error_of(path) == (
        f"{path}:8: services[1].name: duplicate service name 'hb-a' (also services[0])"
    )


def test_two_main_services(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        GOOD.replace(
            "service: heartbeat\n    settings:\n      interval_s",
            "service: heartbeat\n    main: true\n    settings:\n      interval_s",
        ),
    )
    assert "services[1].main: more than one main service" in error_of(path)


def test_zero_main_services_is_allowed(tmp_path: Path) -> None:
    config = load_run_config(write(tmp_path, GOOD.replace("main: true", "main: false")), {})
    assert not any(entry.main for entry in config.services)


def test_unknown_service_kind(tmp_path: Path) -> None:
    path = write(
        tmp_path, GOOD.replace("service: heartbeat\n    main", "service: hartbeat\n    main")
    )
    message = error_of(path)
    assert message.startswith(f"{path}:9: services[1].service: unknown service kind 'hartbeat'")
    assert "did you mean 'heartbeat'?" in message


def test_missing_key_points_at_parent_and_bad_names(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  dir: x\nservices:\n  - name: a\n    service: heartbeat\n")
    assert error_of(path) == f"{path}:1: run.name: Field required"
    path = write(tmp_path, GOOD.replace("name: demo", "name: Demo_Run"))
    assert error_of(path).startswith(f"{path}:2: run.name: String should match pattern")


def test_yaml_syntax_error_and_duplicate_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: demo\nservices: [\n")
    assert error_of(path).startswith(f"{path}:4: invalid YAML")
    path = write(tmp_path, GOOD.replace("  name: demo\n", "  name: demo\n  name: other\n"))
    assert error_of(path) == f"{path}:3: run.name: duplicate key"
    path = write(tmp_path, "- 1\n- 2\n")
    assert "top level of a run config must be a mapping" in error_of(path)


def test_missing_file(tmp_path: Path) -> None:
    assert "cannot read config" in error_of(tmp_path / "nope.yaml")


def test_env_override_applied_and_reported(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    config = load_run_config(path, {"RLFLEET_HEARTBEAT__INTERVAL_S": "0.25"})
    assert [s.settings.interval_s for s in config.services] == [0.25, 0.25]
    settings = settings_from_env(
        HeartbeatSettings, "heartbeat", {"interval_s": 3}, {"RLFLEET_HEARTBEAT__FAIL_AFTER_S": "7"}
    )
    assert settings == HeartbeatSettings(interval_s=3, fail_after_s=7)


def test_bad_env_override_names_variable(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    message = error_of(path, {"RLFLEET_HEARTBEAT__INTERVAL": "1"})
    assert message == (
        "RLFLEET_HEARTBEAT__INTERVAL: unknown key 'interval' for service kind 'heartbeat' "
        "(did you mean 'interval_s'?)"
    )
    message = error_of(path, {"RLFLEET_HEARTBEAT__INTERVAL_S": "-1"})
    assert message.startswith(
        "RLFLEET_HEARTBEAT__INTERVAL_S: services[0].settings.interval_s: Input should be greater"
    )
    with pytest.raises(ConfigError, match=r"RLFLEET_HEARTBEAT__INTERVAL_S: settings\.interval_s"):
        settings_from_env(
            HeartbeatSettings, "heartbeat", {}, {"RLFLEET_HEARTBEAT__INTERVAL_S": "x"}
        )


class Inner(StrictModel):
    depth: int = Field(default=1, ge=1)


class Nested(StrictModel):
    inner: Inner = Inner()
    peers: list[ServiceRef] = []
    extra: dict[str, int] = {}


def test_nested_env_override_and_free_form_mapping() -> None:
    env = {"RLFLEET_DEMO_KIND__INNER__DEPTH": "4", "RLFLEET_DEMO_KIND__EXTRA__ANY_KEY": "2"}
    settings = settings_from_env(Nested, "demo-kind", {}, env)
    assert settings.inner.depth == 4 and settings.extra == {"any_key": 2}
    with pytest.raises(ConfigError, match="RLFLEET_DEMO_KIND__INNER__DEPHT: unknown key 'depht'"):
        settings_from_env(Nested, "demo-kind", {}, {"RLFLEET_DEMO_KIND__INNER__DEPHT": "4"})


def test_settings_validated_at_load_for_python_built_config() -> None:
    config = RunConfig.model_validate(
        {
            "run": {"name": "x"},
            "services": [{"name": "a", "service": "heartbeat", "settings": {"interval_s": 0}}],
        }
    )
    with pytest.raises(ConfigError, match=r"^services\[0\]\.settings\.interval_s: Input should"):
        validate_run_config(config, environ={})


def test_load_service_settings(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    assert load_service_settings("heartbeat", path, "hb-a", {}).interval_s == 0.5
    assert load_service_settings("heartbeat", None, None, {}) == HeartbeatSettings()
    env = {"RLFLEET_HEARTBEAT__INTERVAL_S": "9"}
    assert load_service_settings("heartbeat", None, None, env).interval_s == 9
    with pytest.raises(ConfigError, match="no service named 'hb-x'"):
        load_service_settings("heartbeat", path, "hb-x", {})
    with pytest.raises(ConfigError, match="2 services of kind 'heartbeat'; pass --name"):
        load_service_settings("heartbeat", path, None, {})
    # A service validates only its own entry: its image may lack the other kinds' packages.
    other = write(tmp_path, GOOD.replace("service: heartbeat\n    main", "service: x\n    main"))
    assert load_service_settings("heartbeat", other, None, {}).interval_s == 0.5


def test_service_references_checked_at_load(tmp_path: Path) -> None:
    text = GOOD.replace(
        "interval_s: 0.5", "interval_s: 0.5\n      peers: [hb-main, 10.0.0.1:50051]"
    )
    config = load_run_config(write(tmp_path, text), {})
    assert config.services[0].settings.peers == ["hb-main", "10.0.0.1:50051"]
    path = write(tmp_path, text.replace("[hb-main,", "[hb-mian,"))
    assert error_of(path) == (
        f"{path}:8: services[0].settings.peers[0]: unknown service 'hb-mian' "
        "(did you mean 'hb-main'?)"
    )


def test_cli_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    assert main(["validate", str(write(tmp_path, GOOD))]) == 0
    assert "OK" in capsys.readouterr().out
    bad = write(tmp_path, GOOD.replace("interval_s: 0.5", "interval_s: -1"), "bad.yaml")
    assert main(["validate", str(bad)]) == 2
    assert f"{bad}:7: services[0].settings.interval_s: Input should be" in capsys.readouterr().err


def test_non_utf8_file_is_a_config_error_naming_file_line_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(GOOD.encode().replace(b"  name: demo\n", b"  name: demo  # caf\xe9\n"))
    offset = path.read_bytes().index(b"\xe9")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    message = str(err.value)
    assert message.startswith(f"{path}:2: not UTF-8 text: byte 0xe9 at offset {offset}")
    assert "\n" not in message


def test_validate_command_reports_non_utf8_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main

    path = tmp_path / "run.yaml"
    path.write_bytes(b"run:\n  name: demo\n\xff\xfe\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"rlfleet: error: {path}:3: not UTF-8 text: byte 0xff at offset 18 " + (
        "(invalid start byte); save the file as UTF-8\n"
    )


def test_embedded_nats_restarts_are_bounded_in_config(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD.replace("run:\n", "nats:\n  restarts: -1\nrun:\n", 1))
    with pytest.raises(ConfigError, match=r"run.yaml:2: nats.restarts: Input should be greater"):
        load_run_config(path, environ={})
    assert RunConfig.model_validate({"run": {"name": "r"}, "services": [
        {"name": "a", "service": "heartbeat"}]}).nats.restarts == 5  # fmt: skip


def test_assigned_cpus_are_read_from_the_environment_and_bad_values_ignored() -> None:
    from services.placement import assigned_cpus, format_cpus

    assert assigned_cpus({"RLFLEET_CPUS": format_cpus([0, 3])}) == [0, 3]
    for raw in ("", " ", "0,x", "-1"):
        assert assigned_cpus({"RLFLEET_CPUS": raw}) is None
    assert assigned_cpus({}) is None


def test_a_service_pins_its_threads_and_the_processes_it_started_once(tmp_path: Path) -> None:
    # In a process of its own: pinning is for the rest of a process's life.
    script = """\
import os, subprocess, sys, threading, time
from services.placement import pin_to_assigned_cpus
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
worker = threading.Thread(target=time.sleep, args=(30,), daemon=True)
worker.start()
time.sleep(0.2)
first, again = pin_to_assigned_cpus(), pin_to_assigned_cpus()
mine = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
print(first, again, sorted(mine), sorted(os.sched_getaffinity(child.pid)))
child.kill()
"""
    last = sorted(os.sched_getaffinity(0))[-1]
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "RLFLEET_CPUS": str(last)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"[{last}] None [({last},)] [{last}]"

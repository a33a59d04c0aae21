"""The `process` service kind's settings: argv, env, placeholders, and the checks a run file's
load makes (referenced services exist and have an address, the program can be found)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.config import load_run_config
from services.errors import ConfigError
from services.process import ProcessSettings, check_command, substitute
from services.registry import ServiceContext, get_service


def _write(tmp_path: Path, services: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("run: {name: r}\nservices:\n" + services)
    return path


HB = "  - {name: hb, service: heartbeat}\n"


def test_the_kind_is_registered_without_grpc_health() -> None:
    spec = get_service("process")
    assert spec.settings is ProcessSettings and spec.grpc is False and spec.check is not None


def test_env_numbers_become_strings_and_refs_are_found() -> None:
    s = ProcessSettings(
        command=["game", "--peer", "{address:hb}", "{run_dir}/x"],
        env={"BOARDS": 8, "RATE": 0.5, "ADDR": "{address:env-0}", "JSON": '{"a": 1}'},
    )
    assert s.env["BOARDS"] == "8" and s.env["RATE"] == "0.5"
    assert list(s.address_refs()) == [(("command", 2), "hb"), (("env", "ADDR"), "env-0")]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"command": []}, "at least 1 item"),
        ({"command": [" "]}, "command[0] (the program) must not be empty"),
        ({"command": ["g", "{adress:hb}"]}, "unknown placeholder '{adress:hb}'"),
        ({"command": ["g", "{run:x}"]}, "unknown placeholder '{run:x}'"),
        ({"command": ["g"], "env": {"BAD-NAME": "1"}}, "not a valid environment variable name"),
        ({"command": ["g"], "env": {"ON": True}}, "env.ON: must be a string or a number"),
        ({"command": ["g"], "env": {"A": "{address:}"}}, "unknown placeholder '{address:}'"),
    ],
)
def test_bad_settings_say_what_is_wrong(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        ProcessSettings.model_validate(settings)
    assert message in str(err.value)


def test_placeholders_resolve_from_the_context(tmp_path: Path) -> None:
    settings = ProcessSettings(command=["g"])
    ctx = ServiceContext(
        name="game-0",
        kind="process",
        settings=settings,
        run_name="snake",
        run_dir=tmp_path / "runs" / "snake",
        endpoints={"env-0": "127.0.0.1:5001"},
    )
    text = "--at {address:env-0} --run {run} --dir {run_dir} --raw {address:10.1.1.1:9}"
    assert substitute(text, ctx) == (
        f"--at 127.0.0.1:5001 --run snake --dir {tmp_path}/runs/snake --raw 10.1.1.1:9"
    )
    with pytest.raises(ConfigError, match="unknown service 'env-9'"):
        substitute("{address:env-9}", ctx)


def test_unknown_service_in_a_placeholder_names_the_key_and_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        HB + "  - name: game\n    service: process\n    settings:\n"
        f"      command: [{sys.executable}]\n      env:\n        PEER: '{{address:hbb}}'\n",
    )
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    assert "run.yaml:9: services[1].settings.env.PEER: unknown service 'hbb'" in str(err.value)
    assert "did you mean 'hb'" in str(err.value)


def test_a_service_without_an_address_cannot_be_referenced(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        f"  - {{name: a, service: process, settings: {{command: [{sys.executable}]}}}}\n"
        "  - name: b\n    service: process\n"
        f"    settings: {{command: [{sys.executable}, '{{address:a}}']}}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_run_config(path, environ={})
    assert "services[1].settings.command[1]: service 'a' (process) has no address" in str(err.value)


def test_a_missing_program_fails_rlfleet_validate_and_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch.cli import main as rlfleet

    path = tmp_path / "run.yaml"
    path.write_text(
        f"run: {{name: r, dir: {tmp_path / 'run'}}}\nservices:\n"
        + HB
        + "  - {name: g, service: process, settings: {command: [nodx]}}\n"
    )
    for command in ("validate", "up"):
        assert rlfleet([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert "run.yaml:4: services[1].settings.command[0]: program 'nodx' is not on PATH" in err
    assert not (tmp_path / "run").exists()  # `up` started nothing
    # Readers of a run's config copy (play, export) do not check this machine.
    assert load_run_config(path, environ={}).service("g").settings.command == ["nodx"]


def test_a_relative_program_is_looked_up_from_cwd_relative_to_the_run_file(tmp_path: Path) -> None:
    game = tmp_path / "bin" / "game"
    game.parent.mkdir()
    game.write_text("#!/bin/sh\n")
    settings = ProcessSettings(command=["./game"], cwd="bin")
    assert check_command(settings, tmp_path) == [
        (("command", 0), f"program {game} is not executable (chmod +x it)")
    ]
    game.chmod(0o755)
    assert check_command(settings, tmp_path) == []
    missing = ProcessSettings(command=["./game"])  # cwd: the run file's folder, no game there
    assert "not found (looked at" in check_command(missing, tmp_path)[0][1]
    assert check_command(ProcessSettings(command=["sh"], cwd="nowhere"), tmp_path) == [
        (("cwd",), f"working directory {tmp_path / 'nowhere'} does not exist")
    ]


def test_a_good_process_entry_loads(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        HB + "  - name: g\n    service: process\n    settings:\n"
        f"      command: [{sys.executable}, -c, 'pass', '{{address:hb}}']\n"
        "      env: {RUN: '{run}'}\n",
    )
    settings = load_run_config(path, environ={}).service("g").settings
    assert isinstance(settings, ProcessSettings) and settings.env == {"RUN": "{run}"}


def test_the_context_knows_the_run_files_folder(tmp_path: Path) -> None:
    settings = ProcessSettings(command=["g"])
    environ = {"RLFLEET_CONFIG_DIR": str(tmp_path), "RLFLEET_RUN_NAME": "r"}
    ctx = ServiceContext.from_environment("process", settings, environ=environ)
    assert ctx.config_dir == tmp_path
    assert ServiceContext.from_environment("process", settings, environ={}).config_dir == Path.cwd()


def _context(tmp_path: Path, command: list[str]) -> ServiceContext[ProcessSettings]:
    settings = ProcessSettings(command=command, stop_grace_s=2.0)
    return ServiceContext(
        name="g", kind="process", settings=settings, run_dir=tmp_path, config_dir=tmp_path
    )


def test_a_program_missing_at_start_is_a_permanent_failure(tmp_path: Path) -> None:
    from services.errors import is_permanent
    from services.process import main

    with pytest.raises(ConfigError) as err:
        asyncio.run(main(_context(tmp_path, ["./gone"])))
    assert is_permanent(err.value) and "command[0]: program './gone' not found" in str(err.value)
    (tmp_path / "notes.txt").write_text("not a program")
    (tmp_path / "notes.txt").chmod(0o755)
    with pytest.raises(ConfigError, match=r"command\[0\]: cannot start './notes.txt': Exec"):
        asyncio.run(main(_context(tmp_path, ["./notes.txt"])))


def test_a_failing_command_is_an_error_and_a_clean_exit_is_not(tmp_path: Path) -> None:
    from services.process import main

    with pytest.raises(RuntimeError, match=r"sh -c 'exit 4' failed \(exit 4\)"):
        asyncio.run(main(_context(tmp_path, ["sh", "-c", "exit 4"])))
    asyncio.run(main(_context(tmp_path, ["sh", "-c", "exit 0"])))


def test_stop_ends_what_the_command_started_too(tmp_path: Path) -> None:
    from services.process import main

    # The shell starts a background sleep (a grandchild of the service) and waits for it.
    ctx = _context(tmp_path, ["sh", "-c", "sleep 300 & echo $! > sleep.pid; wait"])
    pid_file = tmp_path / "sleep.pid"

    async def run_then_stop() -> None:
        task = asyncio.create_task(main(ctx))
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.05)
        ctx.stop_event.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(run_then_stop())
    sleep_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{sleep_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed; its parent (the shell) is gone, so init reaps it
    stat = Path(f"/proc/{sleep_pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_the_command_starts_only_once_the_services_it_names_are_healthy(tmp_path: Path) -> None:
    from services.ports import free_port
    from services.process import main
    from services.server import GrpcServer

    port = free_port()
    ctx = _context(tmp_path, ["sh", "-c", "echo $PEER > started"])
    ctx.settings = ProcessSettings(command=ctx.settings.command, env={"PEER": "{address:hb}"})
    ctx.endpoints = {"hb": f"127.0.0.1:{port}"}

    async def scenario() -> None:
        task = asyncio.create_task(main(ctx))
        await asyncio.sleep(1.5)
        assert not (tmp_path / "started").exists() and not task.done()
        server = GrpcServer("hb", port=port)
        await server.start()
        await asyncio.sleep(1.0)  # listening, but not SERVING yet
        assert not (tmp_path / "started").exists()
        server.set_serving()
        try:
            await asyncio.wait_for(task, 15)
        finally:
            await server.stop()

    asyncio.run(scenario())
    assert (tmp_path / "started").read_text().strip() == f"127.0.0.1:{port}"

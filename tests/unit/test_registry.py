"""Service registry and ServiceContext: real entry points, except the duplicate-name case."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from services import registry
from services.builtin import SPEC, HeartbeatSettings
from services.errors import ConfigError
from services.registry import (
    SERVICES_GROUP,
    ServiceContext,
    entry_point_registry,
    get_service,
    service_kinds,
)


def test_heartbeat_is_registered() -> None:
    assert "heartbeat" in service_kinds()
    assert get_service("heartbeat") is SPEC
    assert SPEC.settings is HeartbeatSettings and SPEC.grpc
    plugins = entry_point_registry(SERVICES_GROUP)
    assert plugins.target("heartbeat") == "services.builtin:SPEC"
    assert entry_point_registry(SERVICES_GROUP) is plugins  # cached


def test_unknown_kind_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown service kind 'hartbeat' \(did you mean"):
        get_service("hartbeat")


def test_duplicate_entry_point_names_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "rlfleet.test-duplicates"
    entry_points = [
        EntryPoint("same", "pkg_a.mod:SPEC", group),
        EntryPoint("same", "pkg_a.mod:SPEC", group),  # one package seen twice: not a clash
        EntryPoint("other", "pkg_c:SPEC", group),
    ]
    monkeypatch.setattr(registry, "_entry_points", lambda g: list(entry_points))
    entry_point_registry.cache_clear()
    try:
        assert sorted(entry_point_registry(group)) == ["other", "same"]
        entry_points.append(EntryPoint("same", "pkg_b.mod:SPEC", group))
        entry_point_registry.cache_clear()
        with pytest.raises(ConfigError, match=r"'same' is registered twice.*pkg_a.*pkg_b"):
            entry_point_registry(group)
    finally:
        entry_point_registry.cache_clear()


def test_entry_point_that_fails_to_import_is_a_config_error() -> None:
    plugins = registry.EntryPointRegistry(
        "g", {"broken": EntryPoint("broken", "no_such_module_xyz:SPEC", "g")}
    )
    with pytest.raises(ConfigError, match=r"'broken'.*failed to load: ModuleNotFoundError"):
        plugins["broken"]


def test_context_from_environment_and_resolve() -> None:
    env = {
        "RLFLEET_RUN_NAME": "demo",
        "RLFLEET_RUN_DIR": "/tmp/runs/demo",
        "RLFLEET_NATS_URL": "nats://127.0.0.1:4222",
        "RLFLEET_ENDPOINTS": json.dumps({"env-a": "127.0.0.1:5001"}),
        "RLFLEET_METRICS_PORT": "9100",
    }
    ctx = ServiceContext.from_environment(
        "heartbeat", HeartbeatSettings(), name="hb", port=7000, environ=env
    )
    assert (ctx.name, ctx.kind, ctx.run_name, ctx.run_dir) == (
        "hb",
        "heartbeat",
        "demo",
        Path("/tmp/runs/demo"),
    )
    assert (ctx.host, ctx.port, ctx.metrics_port) == ("127.0.0.1", 7000, 9100)
    assert ctx.nats_url == "nats://127.0.0.1:4222"
    assert ctx.resolve("env-a") == "127.0.0.1:5001"
    assert ctx.resolve("otherhost:80") == "otherhost:80"
    with pytest.raises(ConfigError, match="unknown service 'env-b'"):
        ctx.resolve("env-b")
    assert not ctx.stop_event.is_set()


def test_context_defaults_and_bad_environment() -> None:
    ctx = ServiceContext.from_environment("heartbeat", HeartbeatSettings(), environ={})
    assert (ctx.name, ctx.run_name, ctx.run_dir, ctx.nats_url, ctx.metrics_port, ctx.endpoints) == (
        "heartbeat",
        "local",
        Path("runs/local"),
        None,
        None,
        {},
    )
    with pytest.raises(ConfigError, match="RLFLEET_ENDPOINTS: not valid JSON"):
        ServiceContext.from_environment(
            "k", HeartbeatSettings(), environ={"RLFLEET_ENDPOINTS": "{"}
        )
    with pytest.raises(ConfigError, match="RLFLEET_ENDPOINTS: must be a JSON object"):
        ServiceContext.from_environment(
            "k", HeartbeatSettings(), environ={"RLFLEET_ENDPOINTS": "[]"}
        )
    with pytest.raises(ConfigError, match="RLFLEET_METRICS_PORT: not a port"):
        ServiceContext.from_environment(
            "k", HeartbeatSettings(), environ={"RLFLEET_METRICS_PORT": "x"}
        )


def test_a_command_plugin_that_fails_to_import_breaks_only_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import cli

    real = registry._entry_points

    def with_broken(group: str) -> list[EntryPoint]:
        extra = [EntryPoint("broken-cmd", "no_such_module_xyz:CMD", group)]
        return real(group) + (extra if group == cli.COMMANDS_GROUP else [])

    monkeypatch.setattr(registry, "_entry_points", with_broken)
    assert cli.main(["validate", "/nonexistent.yaml"]) == 2  # other commands still work
    assert cli.main(["broken-cmd", "x"]) == 2
    err = capsys.readouterr().err
    assert "broken-cmd" in err and "failed to load: ModuleNotFoundError" in err

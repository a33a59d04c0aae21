"""Each replica of one instance names itself (metric labels, session ids): services/registry.py
replica_name, which compose's scaled env servers use (RLFLEET_REPLICA_NAME in compose.yaml)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import yaml

from services.registry import ENV_REPLICA_NAME, ServiceContext, replica_name
from services.settings import StrictModel

ROOT = Path(__file__).resolve().parents[2]


def test_unset_or_empty_is_the_instance_name() -> None:
    # `rlfleet up` runs one process per instance: the instance name tells them apart.
    assert replica_name("env-0", {}, hostname="abc") == "env-0"
    assert replica_name("env-0", {ENV_REPLICA_NAME: "  "}, hostname="abc") == "env-0"


def test_template_takes_the_hostname_and_the_name() -> None:
    env = {ENV_REPLICA_NAME: "{name}@{hostname}"}
    assert replica_name("env-0", env, hostname="3f2a9c1b7d4e") == "env-0@3f2a9c1b7d4e"
    assert replica_name("env-0", {ENV_REPLICA_NAME: "{hostname}"}, hostname="pod-7") == "pod-7"
    assert replica_name("env-0", {ENV_REPLICA_NAME: "edge-a"}, hostname="x") == "edge-a"
    assert replica_name("env-0", env) == f"env-0@{socket.gethostname()}"


def test_two_containers_sharing_one_environment_get_two_names() -> None:
    env = {ENV_REPLICA_NAME: "{name}@{hostname}"}  # what `--scale` copies to every replica
    names = {replica_name("env-0", env, hostname=h) for h in ("3f2a9c1b7d4e", "91c0d2e3f4a5")}
    assert len(names) == 2


def test_the_context_carries_it() -> None:
    settings = StrictModel()
    ctx = ServiceContext.from_environment(
        "env_server", settings, name="env-0", environ={ENV_REPLICA_NAME: "{name}-r"}
    )
    assert (ctx.name, ctx.replica) == ("env-0", "env-0-r")  # settings still found as env-0
    plain = ServiceContext.from_environment("env_server", settings, name="env-0", environ={})
    assert plain.replica == "env-0"
    assert ServiceContext(name="learner", kind="learner", settings=settings).replica == "learner"


def test_compose_env_servers_name_themselves_by_hostname() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    env = compose["services"]["env-server"]["environment"]
    assert env[ENV_REPLICA_NAME] == "{name}@{hostname}"
    assert env["RLFLEET_RUN_CONFIG"]  # the shared game environment is still merged in


def test_env_server_labels_itself_with_its_replica_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from env_server import service as env_service

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake_env_service(**kwargs: object) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(env_service, "EnvService", fake_env_service)
    settings = env_service.EnvServerSettings.model_validate({"game_link": {"enabled": False}})
    ctx = ServiceContext.from_environment(
        "env_server", settings, name="env-0", environ={ENV_REPLICA_NAME: "{name}@{hostname}"}
    )
    with pytest.raises(Stop):
        asyncio.run(env_service.main(ctx))
    assert seen["name"] == f"env-0@{socket.gethostname()}"  # the `server` label of its metrics

